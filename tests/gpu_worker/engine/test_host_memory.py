"""Host memory policy on CPU: what a step frees stays mapped for the next step; what steps stream is on huge pages."""

import mmap
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_worker.engine import EngineConfig, linear
from gpu_worker.engine.host_memory import collapse_onto_huge_pages
from gpu_worker.engine.kernel_choice import choose_kernels
from gpu_worker.engine.linear import Linear, onednn_packs_bf16, pack_linears

# Steps that each make and free three temporaries of the given MiB, as a prefill step's MLP outputs are; prints the
# minor page faults of six steps after the first. In a fresh interpreter (the allocator's thresholds are process-wide
# state) that has loaded what an engine's process loads: the heap it starts from is an engine's.
_STEPS = """
import resource, sys, torch
import gpu_worker.engine.llm_engine
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
    # Six steps kept fault in less than one step's temporaries in all (the heap's layout may leave one or two blocks
    # to fault in once), where glibc alone faults them in again and again.
    assert _faults_after_the_first_step("keep", mib) < pages


def _huge_kib_around(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"{address:#x} is in no mapping")


def _collapse_supported() -> bool:
    release = tuple(int(part) for part in platform.release().split(".")[:2] if part.isdigit())
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return release >= (6, 1) and "[madvise]" in thp


needs_collapse = pytest.mark.skipif(not sys.platform.startswith("linux") or not _collapse_supported(),
                                    reason="MADV_COLLAPSE: Linux 6.1+, huge pages given where asked for (madvise)")


@needs_collapse
def test_collapse_moves_memory_spanning_whole_huge_pages_onto_them_and_keeps_its_values():
    # A private mapping of its own, on ordinary pages: the heap may hold huge pages already.
    region = mmap.mmap(-1, 12 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    values = torch.frombuffer(region, dtype=torch.float32)
    values.copy_(torch.randn(values.numel()))
    expected = values.clone()
    before = _huge_kib_around(values.data_ptr())  # the kernel may have merged it with a neighbour's mapping
    moved = collapse_onto_huge_pages([(values.data_ptr(), values.nbytes)])
    assert moved >= 4 << 21  # 12 MiB hold at least four whole huge pages wherever they start
    assert _huge_kib_around(values.data_ptr()) - before == moved >> 10
    assert torch.equal(values, expected)
    del values
    region.close()


@needs_collapse
def test_collapse_joins_consecutive_allocations_smaller_than_a_huge_page():
    arena = torch.zeros(8 << 20, dtype=torch.uint8)
    pieces = [(arena.data_ptr() + offset, (1 << 20) - 256) for offset in range(0, 8 << 20, 1 << 20)]
    assert all(collapse_onto_huge_pages([piece]) == 0 for piece in pieces)  # no piece spans a huge page alone
    moved = collapse_onto_huge_pages(pieces)
    if moved == 0 and not _the_kernel_collapses_a_fresh_region_now():
        pytest.skip("the kernel has no free huge page now (memory too fragmented to compact one)")
    # joined, they span three or four huge pages; a fragmented host may lack free huge pages for some of them
    assert moved >= 1 << 21


def _the_kernel_collapses_a_fresh_region_now() -> bool:
    region = torch.zeros(4 << 20, dtype=torch.uint8)  # spans at least one whole huge page
    return collapse_onto_huge_pages([(region.data_ptr(), region.numel())]) > 0


@needs_collapse
@pytest.mark.skipif(not onednn_packs_bf16(), reason="oneDNN packs bf16 weights on AVX512-BF16 / AMX CPUs only")
def test_packing_moves_every_packed_weight_onto_huge_pages(monkeypatch):
    collapsed = []

    def recording(spans):
        collapsed.append(list(spans))
        return collapse_onto_huge_pages(spans)

    monkeypatch.setattr(linear, "collapse_onto_huge_pages", recording)
    model = torch.nn.Sequential(Linear(2048, 2048), Linear(2048, 768)).to(torch.bfloat16)
    pack_linears(model, choose_kernels(EngineConfig(""), torch.bfloat16))
    assert collapsed == [[model[0].kernel.packed_span(), model[1].kernel.packed_span()]]
    address, nbytes = model[0].kernel.packed_span()
    assert nbytes == 2048 * 2048 * 2
    first_huge_page = -(-address // (2 << 20)) * (2 << 20)  # the mapping may be split at its start, not inside it
    assert _huge_kib_around(first_huge_page) >= 2048
