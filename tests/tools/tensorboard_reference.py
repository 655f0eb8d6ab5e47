"""Reads a run's TensorBoard folder with TensorBoard's own event loading (EventAccumulator, which
checks every record's CRCs and applies SessionLog START purges as TensorBoard does) and prints its
scalars as JSON: {tag: [[step, value], ...]}. Exit 77 when the tensorboard package is missing.

    python3 tensorboard_reference.py RUN_DIR/tensorboard
"""
import json
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator
except ImportError:
    print("tensorboard is not installed", file=sys.stderr)
    sys.exit(77)

acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
