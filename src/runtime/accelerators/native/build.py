"""Compiling and loading backward_node.cpp: the C++ compiler against torch's headers, cached per source, torch and
Python version (no ninja or CUDA toolkit needed)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

MODULE = "taac_backward_node"
SOURCE = Path(__file__).with_name("backward_node.cpp")


def cache_dir() -> Path:
    return Path(os.environ.get("TAAC_NATIVE_CACHE") or Path.home() / ".cache" / "taac-runtime")


def compile_command(source: Path, target: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include = torch_dir / "include"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    return [
        compiler,
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{include}",
        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        str(source),
        "-o",
        str(target),
        f"-L{torch_dir / 'lib'}",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
        "-ltorch_python",
    ]


def library_path() -> Path:
    """Where the compiled extension of this source, torch and Python goes."""
    tag = hashlib.sha256(
        SOURCE.read_bytes() + f"{torch.__version__}|{sys.version}|{torch.__file__}".encode()
    ).hexdigest()[:16]
    return cache_dir() / f"{MODULE}-{tag}{sysconfig.get_config_var('EXT_SUFFIX')}"


def load_extension():
    """The extension module, compiled first if this source, torch and Python have no build yet."""
    target = library_path()
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            result = subprocess.run(compile_command(SOURCE, built), capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"compiling {SOURCE.name} failed:\n{result.stderr[-4000:]}")
            os.replace(built, target)  # atomic: a concurrent build leaves one whole file
    spec = importlib.util.spec_from_file_location(MODULE, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
