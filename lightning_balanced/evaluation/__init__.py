"""Exact evaluation under DDP: the :class:`DistributedEvalMixin`, :class:`IndexedDataset`, detection post-processing
and COCO mAP.

``mixin`` buffers per-sample outputs and gathers them once per epoch; ``fields`` holds one path per field kind (tensors,
ragged lists, nested structures); ``sample_order`` undoes ``DistributedSampler``'s order and padding; ``store_gather``
exchanges Python objects through the process group's store with a bounded wait; ``detection`` post-processes one
image's boxes with the package's NMS op; ``coco`` computes COCO mAP on the gathered set.
"""

from lightning_balanced.evaluation.coco import coco_map
from lightning_balanced.evaluation.detection import postprocess_detections
from lightning_balanced.evaluation.indexed_dataset import IndexedDataset
from lightning_balanced.evaluation.mixin import DistributedEvalMixin

__all__ = ["DistributedEvalMixin", "IndexedDataset", "coco_map", "postprocess_detections"]
