// Stand-in for CUDA's header on a machine without CUDA (see cuda_emu.h).
#pragma once
#include "cuda_emu.h"
