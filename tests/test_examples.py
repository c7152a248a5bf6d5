"""The examples of the README's "Coming from torch's DataLoader" section, each run as a user runs it:
a fresh interpreter on the script (the S3 one against the session's SeaweedFS server)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from support.s3server import SeaweedServer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_TIMEOUT_S = 120


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run examples/`name` with this checkout's aioloader; its stdout, once it exited 0."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
        timeout=EXAMPLE_TIMEOUT_S, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def test_from_torch_gives_torchs_batches_with_one_import_changed() -> None:
    out = run_example("from_torch.py")
    assert "same batches as torch's DataLoader: yes" in out
    assert "the Loader read every sample once: yes" in out
    assert "DataLoader(dataset=<SlowReads of 96>, batch_size=16" in out


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_labels_from_paths_reach_decode(executor: str) -> None:
    out = run_example("labels_from_paths.py", "--executor", executor, "--epochs", "2")
    assert "labels from paths: 3 classes ['bird', 'cat', 'dog'], every label matched" in out
    assert f"executor={executor!r}" in out
    assert "decode=partial(decode) (with key)" in out


def test_labels_from_paths_reads_a_given_folder(tmp_path: Path) -> None:
    for label in ("x", "y"):
        (tmp_path / label).mkdir()
        for i in range(4):
            Image.new("RGB", (20, 12), (i * 50, 0, 0)).save(tmp_path / label / f"{i}.png")
    out = run_example(
        "labels_from_paths.py", str(tmp_path), "--executor", "thread", "--epochs", "1"
    )
    assert "epoch 0: 8 images" in out
    assert "labels from paths: 2 classes ['x', 'y']" in out


def test_webdataset_from_s3_trains_and_validates(seaweed: SeaweedServer) -> None:
    key, secret = seaweed.credentials
    env = {
        "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1",
    }  # fmt: skip
    prefix = f"s3://{seaweed.bucket}/examples/wds/"
    out = run_example(
        "webdataset_s3.py", prefix, "--endpoint-url", seaweed.endpoint, "--write-demo", env=env
    )
    assert "train epoch 0: 72 samples" in out
    assert "train epoch 1: 72 samples" in out
    assert "validation: 24 samples, the same order every epoch" in out
    status, _ = seaweed.request("GET", "examples/wds/shard-0003.tar")
    assert status == 200  # written by the example itself


def test_the_readme_section_names_the_examples_run_here() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Coming from torch's DataLoader\n")
    section = readme[start : readme.index("\n## ", start + 1)]
    named = set(re.findall(r"examples/(\w+\.py)", section))
    assert named == {"from_torch.py", "labels_from_paths.py", "webdataset_s3.py"}
    for heading in ("### Labels from paths", "### A WebDataset set from S3", "by hand"):
        assert heading in section


def test_mix_resume_continues_the_uninterrupted_sequence_as_the_guide_shows() -> None:
    out = run_example("mix_resume.py")
    assert "uninterrupted: 11 batches; books 23 (28%), web 60 (72%)" in out
    assert "stopped after 4 batches" in out
    assert "resumed in a fresh loader (concurrency 16, executor 'thread'): 7 batches" in out
    assert "resumed sequence equals the uninterrupted one: yes" in out
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide[guide.index("\n### Mixing sources\n") :]
    opening = "prints:\n\n```\n"
    shown = section[section.index(opening) + len(opening) :]
    assert shown[: shown.index("```")] == out  # the guide shows the example's own output


def test_parquet_text_packs_token_batches_from_s3(seaweed: SeaweedServer) -> None:
    key, secret = seaweed.credentials
    env = {
        "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1",
    }  # fmt: skip
    prefix = f"s3://{seaweed.bucket}/examples/parquet/"
    out = run_example(
        "parquet_text.py", prefix, "--endpoint-url", seaweed.endpoint, "--write-demo", env=env
    )
    counts = re.findall(r"epoch (\d): (\d+) batches of 8x64 tokens; (\d+) row groups", out)
    assert [c[0] for c in counts] == ["0", "1"]
    assert counts[0][1] == counts[1][1]  # the same tokens, packed anew
    assert int(counts[0][1]) > 50
    # 3 files of 4 row groups, read once per epoch; from the second epoch on, the next epoch's
    # first row groups are read early (all 12 at most here: no third epoch comes to use them)
    assert int(counts[0][2]) == 12
    assert 2 * 12 <= int(counts[1][2]) <= 3 * 12


def test_pretraining_learns_and_resumes_from_a_checkpoint_exactly(tmp_path: Path) -> None:
    out = run_example("pretraining.py", "--steps", "48", "--folder", str(tmp_path))
    assert "corpora: 4 Parquet files" in out
    assert "step 24: restarted from the checkpoint" in out
    assert "the batches after the restart are the uninterrupted run's: yes" in out
    first, last = (
        float(x) for x in re.findall(r"loss: ([\d.]+) over the first 6 steps, ([\d.]+)", out)[0]
    )
    assert last < first


@pytest.mark.slow  # three torchrun jobs (4, 4 and 2 processes): about 40 s on two cores
def test_pretraining_on_a_mesh_restarts_exactly_and_elsewhere_without_repeats(
    tmp_path: Path,
) -> None:
    out = run_example("pretraining_mesh.py", "--steps", "12", "--folder", str(tmp_path))
    assert "each tensor-parallel pair read the same batches: yes" in out
    assert "the two data-parallel pairs different ones: yes" in out
    assert "the batches after the restart are the uninterrupted run's: yes" in out
    assert re.search(r"size 2 -> 1\): [1-9]\d* documents begun after the restart, none of", out)
    assert out.rstrip().endswith("yes")
