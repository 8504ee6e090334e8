"""What `gpuflow run` shows of a job's log (tasks/compute.py): the line a terminal would show."""

from gpuflow.tasks.compute import EPOCH_LINE, visible


def test_a_progress_bar_drawn_on_an_epoch_line_is_not_shown():
    """A raw line of a job's log as Ray forwards it (a Ray Data progress bar, then the controller's epoch line)."""
    epoch = "(TrainController pid=14569) [gpuflow] epoch 3: train_loss=0.2934 val_accuracy=0.95"
    raw = ("\r(pid=14686) Running Dataset dataset_4.: 0.00 row [00:00, ? row/s]\r" + " " * 40 + "\r\x1b[A"
           + "\x1b[36m" + epoch + "\x1b[0m")
    assert visible(raw) == epoch and EPOCH_LINE.search(visible(raw)).group(1) == "3"
    assert visible("plain line  ") == "plain line" and visible("\r \r") == ""
