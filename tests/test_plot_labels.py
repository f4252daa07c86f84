"""The summaries' label placement: labels of points a few pixels apart overlap neither each other, nor
any point's marker, nor the axes' edges, checked box by box after the figure is drawn (the leader
lines of labels placed farther out may cross other labels)."""

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from pardec.benchmarks.plot_labels import MARKER_RADIUS_PT, label_points, overlap_area  # noqa: E402


def drawn_figure(points):
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.scatter([x for x, _, _ in points], [y for _, y, _ in points], s=180, marker="*")
    ax.set_xlim(0.0, 2.0)
    ax.set_ylim(20.0, 100.0)
    fig.tight_layout()
    notes = label_points(ax, points)
    fig.canvas.draw()
    return fig, ax, notes


def test_overlap_area_of_boxes():
    a = Bbox.from_bounds(0, 0, 4, 2)
    assert overlap_area(a, Bbox.from_bounds(3, 1, 4, 4)) == pytest.approx(1.0)
    assert overlap_area(a, Bbox.from_bounds(5, 0, 1, 1)) == 0.0


def test_clustered_labels_overlap_nothing():
    # seven points within a few pixels (the CPU MDM decoders at one accuracy), two GPU runs on top of
    # each other, one far away
    points = [(0.22, 23.3, "FreeCache+guided"), (0.43, 23.3, "LLaDA 1/step"), (0.47, 23.3, "Fast-dLLM"),
              (0.49, 23.3, "FreeCache"), (0.56, 23.3, "FreeCache (freeze last)"), (0.45, 26.7, "WINO"),
              (0.47, 26.7, "COVER"), (1.0, 95.0, "AR greedy (H100)"), (1.02, 95.0, "AR greedy (H200, CUDA graphs)"),
              (1.7, 47.0, "ISD N=4")]
    fig, ax, notes = drawn_figure(points)
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(n, renderer) for n in notes]  # the text, without its leader line
    radius = MARKER_RADIUS_PT * fig.dpi / 72.0
    markers = [Bbox.from_bounds(cx - radius, cy - radius, 2 * radius, 2 * radius)
               for cx, cy in (ax.transData.transform((x, y)) for x, y, _ in points)]
    frame = ax.get_window_extent(renderer)
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        assert overlap_area(a, b) < 1.0, (points[i][2], points[j][2])
    for box, (_, _, text) in zip(boxes, points):
        assert all(overlap_area(box, m) < 1.0 for m in markers), text
        assert overlap_area(box, frame) == pytest.approx(box.width * box.height), text
    plt.close(fig)


def test_label_stays_next_to_its_point():
    fig, ax, notes = drawn_figure([(1.0, 60.0, "alone")])
    box = notes[0].get_window_extent(fig.canvas.get_renderer())
    cx, cy = ax.transData.transform((1.0, 60.0))
    radius = MARKER_RADIUS_PT * fig.dpi / 72.0
    # the first candidate: just right of the marker, vertically centred on the point
    assert box.x0 == pytest.approx(cx + radius + 1.5 * fig.dpi / 72.0, abs=1.0)
    assert (box.y0 + box.y1) / 2 == pytest.approx(cy, abs=1.0)
    plt.close(fig)
