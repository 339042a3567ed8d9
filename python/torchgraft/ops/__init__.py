"""torchgraft's own operators (``torch.ops.torchgraft.*``): one folder per op.

Each op's schema and CPU / CUDA kernels are defined in Rust (crates/graft-native/src/ops/<op>);
its folder here holds the float64 ``reference`` (and the eager expressions models write), and
what only Python can give: ``fake`` (the fake functions for ``torch.compile``; importing it
defines the op, :mod:`.define`) and ``autograd`` (the autograd formula). Their Python face is
:mod:`torchgraft.functional`. The aten grafts live in :mod:`torchgraft.grafts`.
"""
