"""GPU kernels written in Triton (optional: imported only on CUDA, where torch ships Triton).

Rule: kernels/ imports nothing of flashrt. Each module follows one order: kernel(s) -> launcher
that checks shapes and dtypes and plans the launch on the host -> Python wrapper taking `out=`
-> pure-torch reference for the tests.
"""
