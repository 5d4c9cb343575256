"""CUDA C++ kernel sources, shipped as package data and compiled at run time with NVRTC."""
