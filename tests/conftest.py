"""Shared test configuration: GPU tests skip cleanly on machines without CUDA; a raw tar writer."""

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
