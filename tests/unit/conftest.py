"""CPU tier: runs Triton kernels under Triton's interpreter (TRITON_INTERPRET=1).

The flag is read when a kernel is defined, so it is set here, before any kernel module imports.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.accelerators.backends import clear_decisions  # noqa: E402

NVCC = shutil.which("nvcc")
requires_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: TileLang kernels cannot be compiled here")
SM90A = {"kind": "cuda", "arch": "sm_90a"}


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    """Each test starts with no cached backend decisions or emitted fallback warnings."""
    clear_decisions()
    torch.manual_seed(0)
    yield
    clear_decisions()
