"""Builds the engine's native kernels (engine/native/*.c) with the package; metadata is in pyproject.toml.

The library has no Python API: engine/ops/native.py loads it with ctypes. OpenMP comes from the runtime torch
already loaded into the process (same soname, libgomp.so.1).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "engine.native._native",
    sources=["engine/native/cpu.c", "engine/native/act_quant.c", "engine/native/kquant.c",
             "engine/native/packed_x16.c", "engine/native/packed_nib.c", "engine/native/packed_iq4_xs.c", "engine/native/packed_q23_k.c", "engine/native/q8_0.c", "engine/native/gdn.c", "engine/native/group.c",
             "engine/native/attention.c", "engine/native/moe.c", "engine/native/pool.c",
             "engine/native/norm.c", "engine/native/layer.c", "engine/native/kquant_more.c", "engine/native/legacy.c",
             "engine/native/half.c", "engine/native/iq_grid.c", "engine/native/trace.c", "engine/native/sketch.c",
             "engine/native/token_mask.c", "engine/native/border.c"],
    depends=["engine/native/kernels.h", "engine/native/layer.h", "engine/native/iq_tables.h"],
    # No FP contraction: the GDN kernel fuses one token's update with the next token's decay and relies on
    # every element seeing the same multiplies and adds, fused or not (FMA would round differently).
    extra_compile_args=["-O3", "-fopenmp", "-Wall", "-ffp-contract=off"],
    extra_link_args=["-fopenmp"],
)])
