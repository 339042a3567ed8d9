"""torchgraft: graft fast kernels under PyTorch's own operators.

Importing torchgraft changes nothing; ``torchgraft.enable()`` installs the grafts.
"""
