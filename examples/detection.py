"""Detect handwritten digits on canvases: LR-scaled DDP with SyncBatchNorm, exact evaluation, our NMS, COCO mAP.

The data are scikit-learn's bundled 8x8 handwritten digits (real images, no download), pasted at random scales and
positions, several per 64x64 canvas, from a fixed seed. The model is a small anchor-free detector in the style of
CenterNet (Zhou et al. 2019, "Objects as Points"): a BatchNorm CNN at stride 4 predicts a heatmap of digit centres per
class, plus each digit's size and sub-cell offset. Training runs under ``ddp_lr_linear`` (the learning rate scaled by
the world size, SyncBatchNorm over the ranks); at each validation, every rank decodes its images, post-processes them
with :func:`lightning_balanced.postprocess_detections` (class-aware NMS through our ``batched_nms``) and hands them to
:class:`lightning_balanced.DistributedEvalMixin`, whose single gather gives every rank the whole validation set once;
:func:`lightning_balanced.coco_map` scores it with pycocotools. Run from the repository root::

    lightning-balanced fit --config examples/configs/detection_ddp_lr_linear.yaml

(or ``python -m lightning_balanced ...``, or ``python examples/detection.py ...``). At the end, rank 0 prints
``detection: map=... map_50=... scaled_lr=... lr_scale_factor=... wall_s=...``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_balanced import DistributedEvalMixin, IndexedDataset, coco_map, postprocess_detections
from lightning_balanced.cli import LightningBalancedCLI

NUM_CLASSES = 10
STRIDE = 4  # output cell size in canvas pixels


# ---- data -----------------------------------------------------------------------------------------------------------
def _iou(box: Tensor, boxes: Tensor) -> Tensor:
    lt = torch.maximum(box[:2], boxes[:, :2])
    rb = torch.minimum(box[2:], boxes[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    area = (box[2:] - box[:2]).prod()
    areas = (boxes[:, 2:] - boxes[:, :2]).prod(1)
    return inter / (area + areas - inter)


def make_canvases(
    digits: Tensor,
    labels: Tensor,
    count: int,
    *,
    canvas_size: int,
    min_digits: int,
    max_digits: int,
    min_size: int,
    max_size: int,
    seed: int,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Paste digits at random sizes and positions on ``count`` blank canvases.

    Each canvas gets ``min_digits..max_digits`` digits, each resized (bilinear) to a random square side in
    ``min_size..max_size`` pixels and placed where its box overlaps no earlier one by more than IoU 0.1. The box is
    the digit's ink (pixels above 2/16 in the 8x8 source), mapped to the canvas.

    Returns:
        images (Tensor[count, 1, canvas_size, canvas_size], float32 in [0, 1]), and per canvas the boxes
        (Tensor[G, 4] float32, ``(x1, y1, x2, y2)`` in pixels) and labels (Tensor[G] int64).
    """
    generator = torch.Generator().manual_seed(seed)
    images = torch.zeros(count, 1, canvas_size, canvas_size)
    all_boxes, all_labels = [], []
    ink = digits > 2.0
    for i in range(count):
        boxes: list[Tensor] = []
        classes: list[int] = []
        wanted = int(torch.randint(min_digits, max_digits + 1, (1,), generator=generator))
        for _ in range(20 * wanted):
            if len(boxes) == wanted:
                break
            j = int(torch.randint(len(digits), (1,), generator=generator))
            side = int(torch.randint(min_size, max_size + 1, (1,), generator=generator))
            x, y = (int(v) for v in torch.randint(canvas_size - side + 1, (2,), generator=generator))
            rows, cols = ink[j].any(1).nonzero(), ink[j].any(0).nonzero()
            box = torch.tensor(
                [x + cols.min() * side / 8, y + rows.min() * side / 8, x + (cols.max() + 1) * side / 8,
                 y + (rows.max() + 1) * side / 8],
                dtype=torch.float32,
            )  # fmt: skip
            if boxes and _iou(box, torch.stack(boxes)).max() > 0.1:
                continue
            patch = F.interpolate(digits[j][None, None] / 16.0, size=(side, side), mode="bilinear", align_corners=False)
            region = images[i, :, y : y + side, x : x + side]
            torch.maximum(region, patch[0], out=region)
            boxes.append(box)
            classes.append(int(labels[j]))
        all_boxes.append(torch.stack(boxes))
        all_labels.append(torch.tensor(classes, dtype=torch.long))
    return images, all_boxes, all_labels


def centernet_targets(boxes: list[Tensor], labels: list[Tensor], canvas_size: int) -> tuple[Tensor, ...]:
    """Training targets at stride ``STRIDE``: class heatmaps (a Gaussian at each centre), sizes, offsets, a mask.

    Returns:
        heatmap (Tensor[N, 10, H, W]), size (Tensor[N, 2, H, W], box width and height in cells), offset
        (Tensor[N, 2, H, W], centre minus its cell), mask (Tensor[N, H, W] bool, the centre cells).
    """
    cells = canvas_size // STRIDE
    n = len(boxes)
    heatmap = torch.zeros(n, NUM_CLASSES, cells, cells)
    size = torch.zeros(n, 2, cells, cells)
    offset = torch.zeros(n, 2, cells, cells)
    mask = torch.zeros(n, cells, cells, dtype=torch.bool)
    grid_y, grid_x = torch.meshgrid(torch.arange(cells), torch.arange(cells), indexing="ij")
    for i, (image_boxes, image_labels) in enumerate(zip(boxes, labels, strict=True)):
        for box, label in zip(image_boxes / STRIDE, image_labels, strict=True):
            cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
            w, h = box[2] - box[0], box[3] - box[1]
            ix, iy = int(cx.clamp(max=cells - 1)), int(cy.clamp(max=cells - 1))
            sigma = max(0.5, 0.15 * float(w + h) / 2)
            gaussian = torch.exp(-((grid_x - ix) ** 2 + (grid_y - iy) ** 2) / (2 * sigma**2))
            torch.maximum(heatmap[i, label], gaussian, out=heatmap[i, label])
            size[i, :, iy, ix] = torch.stack([w, h])
            offset[i, :, iy, ix] = torch.stack([cx - ix, cy - iy])
            mask[i, iy, ix] = True
    return heatmap, size, offset, mask


class _Detections(Dataset):
    def __init__(self, images: Tensor, boxes: list[Tensor], labels: list[Tensor]) -> None:
        self.images, self.boxes, self.labels = images, boxes, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.images[index], self.boxes[index], self.labels[index]


def _collate_eval(items: list[tuple[int, tuple[Tensor, Tensor, Tensor]]]) -> tuple[Tensor, Tensor, list, list]:
    indices = torch.tensor([index for index, _ in items])
    images = torch.stack([sample[0] for _, sample in items])
    return indices, images, [sample[1] for _, sample in items], [sample[2] for _, sample in items]


class DigitCanvasDataModule(pl.LightningDataModule):
    """Canvases of scikit-learn digits with boxes; train and validation canvases use disjoint digit images.

    Args:
        train_canvases: number of training canvases.
        val_canvases: number of validation canvases.
        batch_size: canvases per batch on each process.
        canvas_size: canvas side in pixels (a multiple of 4).
        min_digits: fewest digits per canvas.
        max_digits: most digits per canvas.
        min_size: smallest digit side in pixels.
        max_size: largest digit side in pixels.
        seed: seed of the digit split and of the canvases.
    """

    def __init__(
        self,
        train_canvases: int = 4000,
        val_canvases: int = 500,
        batch_size: int = 32,
        canvas_size: int = 64,
        min_digits: int = 2,
        max_digits: int = 4,
        min_size: int = 14,
        max_size: int = 28,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if canvas_size % STRIDE:
            raise ValueError(f"`canvas_size` must be a multiple of {STRIDE}, got {canvas_size}")
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        """Build the canvases (a few seconds) and the training targets."""
        hp = self.hparams
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32)
        labels = torch.tensor(digits.target, dtype=torch.long)
        train_idx, val_idx = train_test_split(
            range(len(labels)), test_size=0.2, stratify=digits.target, random_state=hp.seed
        )
        options = {k: hp[k] for k in ("canvas_size", "min_digits", "max_digits", "min_size", "max_size")}
        train = make_canvases(images[train_idx], labels[train_idx], hp.train_canvases, seed=hp.seed, **options)
        val = make_canvases(images[val_idx], labels[val_idx], hp.val_canvases, seed=hp.seed + 1, **options)
        self.train_set = TensorDataset(train[0], *centernet_targets(train[1], train[2], hp.canvas_size))
        self.val_set = _Detections(*val)

    def train_dataloader(self) -> DataLoader:
        """Shuffled canvases with their heatmap, size, offset and mask targets."""
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """``(indices, images, boxes, labels)``: every canvas once, with its index for the exact gather."""
        return DataLoader(
            IndexedDataset(self.val_set), batch_size=2 * self.hparams.batch_size, collate_fn=_collate_eval
        )


# ---- model ----------------------------------------------------------------------------------------------------------
def conv_bn_relu(in_channels: int, out_channels: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    """A 3x3 convolution, BatchNorm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride, padding=dilation, dilation=dilation, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def focal_loss(logits: Tensor, heatmap: Tensor) -> Tensor:
    """CenterNet's penalty-reduced focal loss (alpha 2, beta 4), summed and divided by the number of centres."""
    pred = logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    centres = heatmap.eq(1.0)
    positive = (torch.log(pred) * (1 - pred) ** 2)[centres].sum()
    negative = (torch.log(1 - pred) * pred**2 * (1 - heatmap) ** 4)[~centres].sum()
    return -(positive + negative) / centres.sum().clamp(min=1)


class DigitDetector(DistributedEvalMixin, pl.LightningModule):
    """A small CenterNet-style detector: a BatchNorm CNN at stride 4 with heatmap, size and offset heads.

    Args:
        width: channels of the backbone's last stage (the first stages have half).
        lr: base learning rate of AdamW, for one process; ``ddp_lr_*`` strategies scale it.
        weight_decay: AdamW's weight decay.
        top_k: candidate centres decoded per image before post-processing.
        score_threshold: post-processing keeps candidates scoring above this.
        iou_threshold: class-aware NMS threshold of the post-processing.
    """

    def __init__(
        self,
        width: int = 64,
        lr: float = 2e-3,
        weight_decay: float = 1e-4,
        top_k: int = 40,
        score_threshold: float = 0.05,
        iou_threshold: float = 0.5,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        half = width // 2
        self.backbone = nn.Sequential(
            conv_bn_relu(1, half // 2, stride=2),  # 32x32
            conv_bn_relu(half // 2, half, stride=2),  # 16x16: one cell = STRIDE pixels
            conv_bn_relu(half, width),
            conv_bn_relu(width, width, dilation=2),
            conv_bn_relu(width, width, dilation=4),  # receptive field 61 px: the largest digit and its surround
        )
        self.heads = nn.ModuleDict(
            {
                name: nn.Sequential(conv_bn_relu(width, half), nn.Conv2d(half, channels, 1))
                for name, channels in (("heatmap", NUM_CLASSES), ("size", 2), ("offset", 2))
            }
        )
        nn.init.constant_(self.heads["heatmap"][-1].bias, -math.log((1 - 0.1) / 0.1))  # prior 0.1 (CenterNet)
        self._fit_started = 0.0

    def forward(self, images: Tensor) -> dict[str, Tensor]:
        """Raw head outputs for ``(N, 1, H, W)`` images, each ``(N, C, H/4, W/4)``."""
        features = self.backbone(images)
        return {name: head(features) for name, head in self.heads.items()}

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Focal loss on the heatmap, L1 on size and offset at the centres."""
        images, heatmap, size, offset, mask = batch
        out = self(images)
        centres = mask.unsqueeze(1).expand_as(size)
        count = mask.sum().clamp(min=1)
        heat_loss = focal_loss(out["heatmap"], heatmap)
        size_loss = F.l1_loss(out["size"][centres], size[centres], reduction="sum") / count
        offset_loss = F.l1_loss(out["offset"][centres], offset[centres], reduction="sum") / count
        loss = heat_loss + 0.5 * size_loss + offset_loss
        self.log_dict({"heat_loss": heat_loss, "size_loss": size_loss, "offset_loss": offset_loss}, prog_bar=False)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @torch.no_grad()
    def decode(self, out: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        """Peaks of the heatmap (3x3 local maxima, top ``top_k``) -> boxes, then our post-processing per image."""
        heat = out["heatmap"].sigmoid()
        heat = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat)
        n, _, h, w = heat.shape
        scores, flat = heat.flatten(1).topk(self.hparams.top_k)
        labels, cell = flat // (h * w), flat % (h * w)
        ys, xs = cell // w, cell % w
        take = cell.unsqueeze(1).expand(n, 2, -1)
        size = out["size"].flatten(2).gather(2, take)
        offset = out["offset"].flatten(2).gather(2, take)
        cx, cy = xs + offset[:, 0], ys + offset[:, 1]
        boxes = STRIDE * torch.stack(
            [cx - size[:, 0] / 2, cy - size[:, 1] / 2, cx + size[:, 0] / 2, cy + size[:, 1] / 2], 2
        )
        return [
            postprocess_detections(
                b, s, lab, iou_threshold=self.hparams.iou_threshold, score_threshold=self.hparams.score_threshold
            )
            for b, s, lab in zip(boxes.float(), scores.float(), labels, strict=True)
        ]

    def validation_step(self, batch: tuple[Tensor, Tensor, list, list], batch_idx: int) -> None:
        """Buffer each canvas's detections and ground truth under its index (no communication here)."""
        indices, images, boxes, labels = batch
        detections = self.decode(self(images))
        self.add_eval_outputs(
            indices,
            pred_boxes=[d["boxes"] for d in detections],
            pred_scores=[d["scores"] for d in detections],
            pred_labels=[d["labels"] for d in detections],
            gt_boxes=boxes,
            gt_labels=labels,
        )

    def on_validation_epoch_end(self) -> None:
        """One gather, then COCO mAP on the whole validation set, identical on every rank."""
        out = self.gather_eval_outputs()
        predictions = [
            {"boxes": b, "scores": s, "labels": lab}
            for b, s, lab in zip(out["pred_boxes"], out["pred_scores"], out["pred_labels"], strict=True)
        ]
        targets = [{"boxes": b, "labels": lab} for b, lab in zip(out["gt_boxes"], out["gt_labels"], strict=True)]
        metrics = coco_map(predictions, targets)
        # The same values on every rank (gathered above): sync_dist's mean leaves them as they are, and tells Lightning
        # they need no further syncing (it would warn otherwise).
        self.log_dict({"val_map": metrics["map"], "val_map_50": metrics["map_50"]}, prog_bar=True, sync_dist=True)
        self.log("val_images", float(len(targets)), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with a one-cycle schedule over the whole run (per step)."""
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches, pct_start=0.15
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        """Start the clock."""
        self._fit_started = time.perf_counter()

    def on_fit_end(self) -> None:
        """Print the final figures on rank 0: mAP, mAP@0.5, the scaled peak learning rate, the wall time of fit."""
        wall_s = time.perf_counter() - self._fit_started
        if not self.trainer.is_global_zero:
            return
        metrics = self.trainer.callback_metrics
        group = self.trainer.optimizers[0].param_groups[0]
        print(
            f"detection: map={float(metrics.get('val_map', math.nan)):.4f}"
            f" map_50={float(metrics.get('val_map_50', math.nan)):.4f}"
            f" scaled_lr={group.get('max_lr', group['lr']):.6g} lr_scale_factor={group.get('lr_scale_factor', 1.0):.6g}"
            f" images={int(metrics.get('val_images', 0))} epochs={self.trainer.current_epoch}"
            f" steps={self.trainer.global_step} wall_s={wall_s:.1f}",
            flush=True,
        )


def main(args: list[str] | None = None) -> LightningBalancedCLI:
    """``python examples/detection.py fit --config ...``: the same as ``lightning-balanced``."""
    return LightningBalancedCLI(args=args)


if __name__ == "__main__":
    main()
