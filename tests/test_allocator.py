"""fedsim's malloc settings: merged into GLIBC_TUNABLES without overriding the user's, applied with
mallopt in this process, inherited by a local Ray's workers."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from fedsim.engine.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, merged_tunables, tunables


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
def test_freed_blocks_are_reused_not_faulted_in_again():
    """The property the settings exist for: a 16 MiB block (a layer's activations) allocated, freed
    and allocated again faults its pages in a second time with glibc's defaults (served by mmap,
    unmapped when freed), and not with fedsim's (kept in the heap for reuse). Each variant runs in a
    fresh process: mallopt is process-wide."""
    code = (
        "import resource, sys, numpy as np\n"
        "if sys.argv[1] == 'fedsim':\n"
        "    from fedsim.engine.allocator import apply_to_this_process; assert apply_to_this_process()\n"
        "np.ones(4 * 1024 * 1024, dtype=np.float32)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "np.ones(4 * 1024 * 1024, dtype=np.float32)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    faults = {v: int(subprocess.run([sys.executable, "-c", code, v], capture_output=True, text=True,
                                     check=True).stdout.split()[-1]) for v in ("default", "fedsim")}
    assert faults["default"] > 100, faults  # 16 MiB is 4,096 pages (fewer with transparent huge pages)
    assert faults["fedsim"] * 10 < faults["default"], faults
