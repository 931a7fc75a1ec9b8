"""Shared test configuration: GPU tests skip cleanly on machines without CUDA; a raw tar writer; the
per-sample mRoPE oracle."""

import io
import tarfile
from pathlib import Path

import pytest
import torch


@pytest.fixture
def write_tar():
    """``write_tar(path, [(member name, bytes), ...]) -> path``: a tar written member by member, as given (for
    shards vlm-pack's own writer would refuse: duplicate or odd names, cut images)."""

    def write(path: Path, members: list[tuple[str, bytes]]) -> Path:
        with tarfile.open(path, "w") as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    return write



@pytest.fixture
def assert_rope_index_per_sample():
    """``check(model, batch, samples, sizes)``: every sample's 4-row position ids in the packed ``batch`` are
    a text arange beside the model's own ``get_rope_index`` of that sample alone (``sizes[k]``: the images of
    sample ``k``, whose ``image_grid_thw`` rows the batch holds in packed order)."""

    def check(model, batch, samples, sizes) -> None:
        assert batch.position_ids.shape == (4, 1, batch.row_length)
        cu = batch.cu_seqlens.tolist()
        grids = iter(batch.image_grid_thw)
        for slot, k in enumerate(batch.sample_index.tolist()):
            s = samples[k]
            grid = torch.stack([next(grids) for _ in sizes[k]]) if sizes[k] else None
            rope, _ = model.model.get_rope_index(
                s["input_ids"][None], mm_token_type_ids=s["mm_token_type_ids"][None], image_grid_thw=grid
            )
            got = batch.position_ids[:, 0, cu[slot] : cu[slot + 1]]
            assert torch.equal(got[1:], rope[:, 0])
            assert torch.equal(got[0], torch.arange(len(s["input_ids"])))

    return check

def pytest_collection_modifyitems(config, items):
    from vlm_pack._compat import VIDEOS_SINCE, installed_transformers_version, videos_supported

    if not videos_supported():  # the matrix's lower bound: video samples are refused there by name
        since = ".".join(map(str, VIDEOS_SINCE))
        skip_video = pytest.mark.skip(
            reason=f"video samples need transformers >= {since} (installed {installed_transformers_version()})"
        )
        for item in items:
            if item.path.name.startswith("test_video_") and "torchvision" in item.keywords:
                item.add_marker(skip_video)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
