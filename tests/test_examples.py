"""The examples run as documented, on a trimmed budget."""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import ON_CPU

# These tests build CPU Trainers through LightningCLI: on a machine with a GPU, Lightning's warning that it is not
# used is expected.
pytestmark = ON_CPU

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (the examples are scripts, not a package)."""
    module_name = f"_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@pytest.fixture(scope="module")
def digits() -> ModuleType:
    pytest.importorskip("sklearn")
    return _load_example("digits")


def test_digits_split_is_stratified_deterministic_and_standardized(digits: ModuleType) -> None:
    first, second = digits.DigitsDataModule(), digits.DigitsDataModule()
    first.setup("fit")
    second.setup("fit")
    x_train, y_train = first.train_set.tensors
    x_val, y_val = first.val_set.tensors
    assert (len(y_train), len(y_val)) == (1437, 360)
    assert x_train.shape[1:] == (1, 8, 8) and x_train.dtype == torch.float32
    assert torch.equal(y_val, second.val_set.tensors[1]) and torch.equal(x_val, second.val_set.tensors[0])
    val_share = torch.bincount(y_val, minlength=10) / torch.bincount(torch.cat([y_train, y_val]), minlength=10)
    assert torch.allclose(val_share, torch.full((10,), 0.2), atol=0.01)
    assert abs(x_train.mean().item()) < 1e-4 and abs(x_train.std().item() - 1) < 1e-4
    assert first.train_dataloader().drop_last


def test_digits_cli_fits_with_balanced_dp_on_two_cpu_devices(
    digits: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["digits.py"])  # LightningCLI warns when given both `args` and sys.argv[1:]
    # Lightning 2.6's cli.py calls jsonargparse APIs deprecated in jsonargparse 4.49 (add_instantiator,
    # instantiate_classes, skip_none); not ours to fix, so use jsonargparse's own switch for these notices.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    started = time.perf_counter()
    cli = digits.main(
        [
            "fit",
            "--config",
            str(EXAMPLES / "configs" / "digits_balanced_dp.yaml"),
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    outer_s = time.perf_counter() - started

    strategy = cli.trainer.strategy
    assert isinstance(strategy, BalancedDataParallelStrategy)
    assert isinstance(cli.trainer.accelerator, CPUAccelerator)
    assert strategy.parallel_devices == [torch.device("cpu")] * 2
    assert strategy.gpu0_bsz == 16
    assert strategy.plan(cli.datamodule.batch_size) == [16, 48]
    assert cli.trainer.global_step == 3

    final = re.search(r"^final: val_acc=(\S+) val_loss=(\S+) epochs=1 wall_s=(\S+)$", capsys.readouterr().out, re.M)
    assert final is not None
    val_acc, val_loss, wall_s = map(float, final.groups())
    # The printed time is fit's alone: more than nothing, and within the whole CLI call timed here (it is printed
    # rounded to 0.1 s, hence the 0.05 s allowance); a time since import, or in ms, would exceed it.
    assert 0.0 < wall_s <= outer_s + 0.05
    # The logged metrics cover the whole validation set exactly, although each batch ran as chunks of 16 and the rest.
    x_val, y_val = cli.datamodule.val_set.tensors
    with torch.no_grad():
        logits = cli.model.eval()(x_val)
    assert val_acc == pytest.approx((logits.argmax(1) == y_val).float().mean().item(), abs=1e-4)
    assert val_loss == pytest.approx(torch.nn.functional.cross_entropy(logits, y_val).item(), abs=1e-4)


@pytest.fixture(scope="module")
def detection() -> ModuleType:
    pytest.importorskip("sklearn")
    pytest.importorskip("pycocotools")
    return _load_example("detection")


def _canvases(detection: ModuleType, count: int = 40, seed: int = 3) -> tuple[torch.Tensor, list, list]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = torch.tensor(digits.images, dtype=torch.float32), torch.tensor(digits.target)
    options = {"canvas_size": 64, "min_digits": 2, "max_digits": 4, "min_size": 14, "max_size": 28}
    return detection.make_canvases(images, labels, count, seed=seed, **options)


def test_detection_canvases_are_seeded_and_hold_several_separate_boxed_digits(detection: ModuleType) -> None:
    images, boxes, labels = _canvases(detection)
    again = _canvases(detection)
    assert torch.equal(images, again[0]) and all(torch.equal(a, b) for a, b in zip(boxes, again[1], strict=True))
    assert not torch.equal(images, _canvases(detection, seed=4)[0])
    assert images.shape == (40, 1, 64, 64) and images.min() >= 0.0 and images.max() <= 1.0
    counts = [len(b) for b in boxes]
    assert min(counts) >= 2 and max(counts) <= 4 and len(set(counts)) > 1
    sides = []
    for image, image_boxes, image_labels in zip(images, boxes, labels, strict=True):
        assert image_labels.dtype == torch.long and image_labels.min() >= 0 and image_labels.max() <= 9
        assert (image_boxes[:, :2] >= 0).all() and (image_boxes[:, 2:] <= 64).all()
        assert (image_boxes[:, 2:] > image_boxes[:, :2]).all()
        sides += (image_boxes[:, 2:] - image_boxes[:, :2]).max(1).values.tolist()
        # The boxes hold the ink (source pixels > 2/16): bilinear resizing blurs it by at most half a source pixel
        # (28 / 16 < 2 canvas pixels), so 2 pixels beyond the boxes only faint source pixels (<= 2/16) remain.
        outside = torch.ones(64, 64, dtype=torch.bool)
        for x1, y1, x2, y2 in image_boxes.tolist():
            outside[max(0, int(y1) - 2) : int(y2) + 3, max(0, int(x1) - 2) : int(x2) + 3] = False
        assert image[0][outside].max() <= 2 / 16 + 1e-6
    assert min(sides) < 16 and max(sides) > 22  # random scales across the range


def test_detection_decodes_its_own_targets_into_the_ground_truth(detection: ModuleType) -> None:
    # Perfect head outputs (the training targets themselves) must decode, through postprocess_detections and our
    # batched_nms, into exactly the ground-truth boxes: COCO mAP 1.0. Any slip in the stride, the offset, the size or
    # the peak extraction lowers it.
    _, boxes, labels = _canvases(detection, count=20)
    heatmap, size, offset, _ = detection.centernet_targets(boxes, labels, 64)
    assert heatmap.amax((2, 3)).sum() == sum(len(set(lab.tolist())) for lab in labels)  # one peak of 1 per class
    logits = torch.logit(heatmap.clamp(1e-6, 1 - 1e-6))
    model = detection.DigitDetector(top_k=40)
    detections = model.decode({"heatmap": logits, "size": size, "offset": offset})
    predictions = [{k: d[k] for k in ("boxes", "scores", "labels")} for d in detections]
    targets = [{"boxes": b, "labels": lab} for b, lab in zip(boxes, labels, strict=True)]
    from lightning_balanced import coco_map

    metrics = coco_map(predictions, targets)
    assert metrics["map"] == pytest.approx(1.0) and metrics["map_50"] == pytest.approx(1.0)
