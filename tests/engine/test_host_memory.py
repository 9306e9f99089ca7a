"""Host memory policy on CPU: what a step frees stays mapped for the next step."""

import subprocess
import sys

import pytest

# Steps that each make and free three temporaries of the given MiB, as a prefill step's MLP outputs are; prints the
# minor page faults of six steps after the first. In a fresh interpreter: the allocator's thresholds are process-wide
# state.
_STEPS = """
import resource, sys, torch
from gpu_worker.engine.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
def step():
    temporaries = [torch.ones(int(sys.argv[2]) << 18) for _ in range(3)]
    del temporaries
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_after_the_first_step(mode: str, mib: int) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode, str(mib)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("mib", [16, 48], ids=["under glibc's 32 MiB mmap ceiling", "past it"])
def test_memory_a_step_frees_is_reused_by_later_steps_without_page_faults(mib):
    pages = 3 * (mib << 20) // 4096  # one step's temporaries
    assert _faults_after_the_first_step("default", mib) > pages  # glibc alone unmaps or trims them, then faults them in
    assert _faults_after_the_first_step("keep", mib) < pages // 2
