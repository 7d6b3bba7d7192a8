"""The reference's limits on the images of one request (deepseek-recipe's `ImageLimits` defaults)."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 600
    max_url_bytes: int = 8192  # UTF-8 length of an external URL
    max_image_bytes: int = 32 * MIB  # one encoded image
    max_total_bytes: int = 64 * MIB  # every encoded image of the request
    max_side: int = 8192  # source width or height, before resizing
    max_side_many: int = 4096  # ... once a request has `many_images` images
    many_images: int = 15
    low_detail_max_side: int = 512

    def max_dimension(self, image_count: int) -> int:
        return self.max_side if image_count < self.many_images else self.max_side_many


@dataclass
class ImageQuota:
    """What the completed resolve calls of one request used; a failed call adds nothing."""

    images: int = 0
    bytes: int = 0
