"""A clip that fails to decode must not leave its decoder to a forked loader worker.

Seen with Energon's loaders: a truncated clip failed in the main process (0 workers), then the next loader
forked its workers, and the first garbage collection in a worker freed the failed clip's threaded PyAV
decoder and hung in ``avcodec_free_context``. The decoder was kept alive by a reference cycle (the
caught error's traceback holds ``Guard.call``'s frame, which held the error), so only a gc freed it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.torchvision

_CHILD = textwrap.dedent(
    """
    import gc, os, sys, time

    from vlm_pack.failures import FailurePolicy
    from vlm_pack.processing.videos import decode_frames
    from vlm_pack.testing.clips import truncated_clip

    clip = truncated_clip()  # its header states 30 frames, the decoder yields fewer
    guard = FailurePolicy("fork-test", "skip", None).stage("process", "decode_error")
    skipped = guard.call(decode_frames, clip, list(range(30)), sample="truncated")
    assert skipped.reason == "decode_error", skipped
    pid = os.fork()
    if pid == 0:
        gc.collect()  # frees whatever only a cycle kept: the hang happened here
        os._exit(0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            print("worker done")
            sys.exit(0)
        time.sleep(0.05)
    os.kill(pid, 9)
    print("worker hung")
    sys.exit(1)
    """
)


def test_a_failed_decode_leaves_no_decoder_to_a_forked_worker():
    pytest.importorskip("av")
    pytest.importorskip("torchvision")
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "worker done" in run.stdout, run.stdout + run.stderr
