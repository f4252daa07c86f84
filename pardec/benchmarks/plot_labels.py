"""Point labels that overlap neither each other nor the points: the summaries' scatter plots put a
dozen decoders within a few pixels of each other (several MDM decoders at one accuracy, the GPU
runs at one TPS ratio), where fixed offsets print labels on top of each other.

Greedy, in display pixels: each label, in the order given, takes the first candidate position
around its point (right, left, above, below, the diagonals, then the same farther out) whose box
overlaps no label placed before it, no point's marker and nothing outside the axes; when no
candidate is free it takes the one with the least overlapping area. Call it after the axes' limits
and the figure's layout are final (it reads the data-to-pixel transform) and save the figure at the
dpi it was drawn with (``savefig(dpi=fig.dpi)``): the offsets are in points, so they scale with it,
but a different dpi rounds the text's size differently.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.text import Annotation
from matplotlib.transforms import Bbox

# A star of ``s=180`` (points squared) spans about 13 points: its radius, and the space left around it.
MARKER_RADIUS_PT = 7.0
GAP_PT = 1.5
# right, left, above, below: next to the point; the diagonals and the outer rings get a leader line
ADJACENT_CANDIDATES = 4


def overlap_area(a: Bbox, b: Bbox) -> float:
    box = Bbox.intersection(a, b)
    return 0.0 if box is None else box.width * box.height


def candidate_offsets(width: float, height: float, radius: float, gap: float) -> list[tuple[float, float]]:
    """Lower-left corners of the label's box relative to its point (pixels), nearest first: eight
    around the marker, then the same eight one label height farther out at each ring."""
    near = radius + gap
    offsets = []
    for ring in range(4):
        step = ring * (height + gap)
        offsets += [(near + step, -height / 2), (-near - width - step, -height / 2),  # right, left
                    (-width / 2, near + step), (-width / 2, -near - height - step),  # above, below
                    (near + step, near + step), (near + step, -near - height - step),  # up-right, down-right
                    (-near - width - step, near + step), (-near - width - step, -near - height - step)]
    return offsets


def label_points(ax: Axes, points: list[tuple[float, float, str]], fontsize: float = 7) -> list[Annotation]:
    """Annotate each ``(x, y, text)`` of ``ax`` (data coordinates) where it overlaps least (see the module)."""
    ax.get_xlim(), ax.get_ylim()  # applies any pending autoscaling before the transform is read
    renderer = ax.figure.canvas.get_renderer()
    points_per_pixel = 72.0 / ax.figure.dpi
    radius, gap = MARKER_RADIUS_PT / points_per_pixel, GAP_PT / points_per_pixel
    frame = ax.get_window_extent(renderer)
    centres = [ax.transData.transform((x, y)) for x, y, _ in points]
    taken = [Bbox.from_bounds(cx - radius, cy - radius, 2 * radius, 2 * radius) for cx, cy in centres]
    notes = []
    for (x, y, text), (cx, cy) in zip(points, centres, strict=True):
        probe = ax.annotate(text, (x, y), fontsize=fontsize, textcoords="offset points", xytext=(0, 0),
                            ha="left", va="bottom")
        size = probe.get_window_extent(renderer)
        probe.remove()
        best: tuple[float, int, Bbox, tuple[float, float]] | None = None
        for index, (dx, dy) in enumerate(candidate_offsets(size.width, size.height, radius, gap)):
            box = Bbox.from_bounds(cx + dx, cy + dy, size.width, size.height)
            outside = box.width * box.height - overlap_area(box, frame)
            cost = sum(overlap_area(box, other) for other in taken) + outside
            if best is None or cost < best[0]:
                best = (cost, index, box, (dx, dy))
            if cost == 0:
                break
        _, index, box, (dx, dy) = best
        # off to a side a thin leader line says which point the label belongs to
        leader = None if index < ADJACENT_CANDIDATES else {"arrowstyle": "-", "lw": 0.5, "color": "grey",
                                                           "shrinkA": 0, "shrinkB": MARKER_RADIUS_PT}
        notes.append(ax.annotate(text, (x, y), fontsize=fontsize, textcoords="offset points", ha="left", va="bottom",
                                 xytext=(dx * points_per_pixel, dy * points_per_pixel), arrowprops=leader))
        taken.append(box)
    return notes
