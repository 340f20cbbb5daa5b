"""Kernels in C++ for the CPU, compiled on first use for the CPU they run on (docs/05).

    cpu_ops.cpp   RMSNorm, residual add + RMSNorm, rotary + K/V store, SiLU-and-mul, paged decode attention
    cpu_ops.py    building and loading them; why not, where they cannot build
"""
