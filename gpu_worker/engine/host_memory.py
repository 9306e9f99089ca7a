"""Host memory: on CPU, what every decode step streams (weights, the KV cache) on transparent huge pages; for
CUDA, a step's inputs in pinned memory.

With 4 KiB pages nearly every few kilobytes streamed cost a TLB miss, which slows the CPU attention kernel over the
KV cache and batch-1 decode over the weights (`tokenfleet bench engine`; bench/RESULTS.md). Linux hands huge pages
out only to memory that asks (`madvise`) when transparent_hugepage is "madvise", as on most servers; elsewhere
ordinary pages serve.
"""

from __future__ import annotations

import ctypes
import errno
import math

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+
_COLLAPSE_TRIES = 4
_ADJACENT_GAP = 64 << 10  # allocator headers and alignment between consecutive allocations
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit hosts


def _libc(name: str):
    """The C library's function `name`, or None where this process has no such library or function."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> None:
    """Keep what a step frees for the next step instead of handing it back to the kernel (process-wide; glibc only).
    Called once an engine holds its long-lived memory (weights, KV cache), which then stays in mappings of its own
    (an engine made later in the same process takes its memory from the heap, as its steps do).

    glibc maps a block over its mmap threshold (which adapts, up to 32 MiB) afresh and unmaps it when freed, and
    trims the heap's free top past twice that threshold, so every step faulted its large temporaries back in, a
    zeroed page at a time, in the kernel's page-fault path. With both thresholds fixed high, and no new mappings at
    all (blocks past the 32 MiB ceiling, such as a 4096-token prefill step's gate_up output on tokenfleet-large,
    would still be mapped afresh), they come from the heap: the mixed workload of `tokenfleet bench engine` runs
    faster. The process keeps its largest step's memory, which the next such step needs anyway (what vLLM-CPU gets by
    preloading tcmalloc)."""
    mallopt = _libc("mallopt")
    if mallopt is None:  # not glibc: its allocator's own policy serves
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    mallopt(_M_MMAP_MAX, 0)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory asks for huge pages (ordinary pages below one huge page)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % _HUGE_PAGE
    if (madvise := _libc("madvise")) is not None:  # elsewhere ordinary pages serve
        madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on `device`. For CUDA through pinned memory with a non-blocking copy: a copy from
    pageable memory would make the host wait for the GPU to finish its queued work, every step."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def zeros_streamed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros for memory every step reads (a KV cache): on huge pages on CPU, plain on other devices."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_page_empty(shape, dtype).zero_()


def move_to_huge_pages_(tensor: torch.Tensor) -> None:
    """Re-home a contiguous CPU tensor's values on huge pages, in place: every holder of this tensor object (a
    tied embedding and its LM head's kernel) keeps sharing the one copy."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.nbytes < _HUGE_PAGE:
        return
    moved = huge_page_empty(tuple(tensor.shape), tensor.dtype)
    moved.copy_(tensor)
    with torch.no_grad():
        tensor.set_(moved.untyped_storage(), moved.storage_offset(), moved.shape, moved.stride())


def move_parameters_to_huge_pages_(module: torch.nn.Module) -> None:
    for param in module.parameters():  # each tied parameter once: it is one object
        move_to_huge_pages_(param)


def collapse_onto_huge_pages(spans: list[tuple[int, int]]) -> int:
    """Moves memory that someone else allocated, given as (address, bytes) spans, onto huge pages where it spans
    whole ones; returns the bytes of those now on huge pages, moved or already there (0 where the kernel cannot:
    before Linux 6.1, or huge pages off).

    For oneDNN's packed weights, which every GEMM of more than a few rows streams and which its own allocation puts on
    4 KiB pages: after a decode step's attention has streamed the KV cache through the caches and the TLB, the next
    GEMM's page walks for its weight come back from memory too. Spans a few bytes apart (consecutive allocations) are
    joined first, so that weights smaller than a huge page still land on them. The kernel copies each 2 MiB range
    into a huge page, preserving its contents: a one-off cost at start-up, against every step's page walks."""
    joined: list[list[int]] = []
    for start, nbytes in sorted(spans):
        if joined and start - joined[-1][1] <= _ADJACENT_GAP:
            joined[-1][1] = max(joined[-1][1], start + nbytes)
        else:
            joined.append([start, start + nbytes])
    madvise = _libc("madvise")
    if madvise is None:  # not Linux
        return 0
    moved = 0
    for start, end in joined:
        for page in range(-(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE, _HUGE_PAGE):
            moved += _HUGE_PAGE if _collapse_one(madvise, page) else 0
    return moved


def _collapse_one(madvise, page: int) -> bool:
    """One huge page at a time: a call over a whole span reports failure when any one of its pages cannot be
    collapsed (in CI one such call over three pages once counted none), so that one page costs only itself. EAGAIN
    is the kernel's word for a transient state (a small page pinned, or briefly off the LRU): worth a few tries."""
    for _ in range(_COLLAPSE_TRIES):
        if madvise(ctypes.c_void_p(page), ctypes.c_size_t(_HUGE_PAGE), _MADV_COLLAPSE) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            return False
    return False
