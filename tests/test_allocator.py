"""fedsim's malloc settings: merged into GLIBC_TUNABLES without overriding the user's, applied with
mallopt in this process, inherited by a local Ray's workers."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from fedsim.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, merged_tunables, tunables


def test_tunables_name_both_thresholds():
    assert tunables() == (f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:"
                          f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}")


def test_user_settings_win_and_others_are_kept():
    assert merged_tunables(None) == tunables()
    mine = "glibc.malloc.trim_threshold=1:glibc.cpu.hwcaps=-AVX512F"
    merged = merged_tunables(mine)
    assert merged.startswith(mine)
    assert merged.count("glibc.malloc.trim_threshold") == 1  # the user's, not ours
    assert f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}" in merged


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_mallopt_stops_repeated_page_faults():
    """The property the settings exist for: a loop that allocates four 4 MiB blocks (a layer's
    activations and gradients) and frees them keeps faulting pages in with glibc's defaults (the
    freed top of the heap goes back to the system), and far less once the memory is kept for reuse.
    Each variant runs in its own process (mallopt is process-wide)."""
    code = (
        "import resource, sys, torch\n"
        "if sys.argv[1] == 'fedsim':\n"
        "    from fedsim.allocator import apply_to_this_process; assert apply_to_this_process()\n"
        "def step(): return [torch.ones(1024 * 1024) for _ in range(4)]\n"
        "for _ in range(3): step()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(100): step()\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    faults = {v: int(subprocess.run([sys.executable, "-c", code, v], capture_output=True, text=True,
                                     check=True).stdout.split()[-1]) for v in ("default", "fedsim")}
    assert faults["fedsim"] * 3 < faults["default"], faults
