"""GPU kernel sources (data, not Python): one body per kernel for both Metal and CUDA.

engine/kernels.py reads these files and compiles them through mx.fast.metal_kernel or
mx.fast.cuda_kernel; README.md in this folder has the table of kernels.
"""
