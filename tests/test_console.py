"""What `gpuflow run` shows of a job's log (tasks/compute.py): the line a terminal would show."""

from gpuflow.tasks.compute import ANSI, EPOCH_LINE, RESULT_LINE, visible


def test_a_progress_bar_drawn_on_an_epoch_line_is_not_shown():
    """A raw line of a job's log as Ray forwards it (a Ray Data progress bar, then the controller's epoch line)."""
    epoch = "(TrainController pid=14569) [gpuflow] epoch 3: train_loss=0.2934 val_accuracy=0.95"
    raw = ("\r(pid=14686) Running Dataset dataset_4.: 0.00 row [00:00, ? row/s]\r" + " " * 40 + "\r\x1b[A"
           + "\x1b[36m" + epoch + "\x1b[0m")
    assert visible(raw) == epoch and EPOCH_LINE.search(visible(raw)).group(1) == "3"
    assert visible("plain line  ") == "plain line" and visible("\r \r") == ""


def test_only_the_jobs_own_result_line_ends_the_tail():
    """The job's last line, bare (local) or behind SkyPilot's task prefix, ends the tail; the same text from a Ray
    worker, or drawn after a progress bar, does not."""
    result = '[gpuflow] result {"metrics": {}}'
    assert RESULT_LINE.match(result) and RESULT_LINE.match(f"(digits-mlp, pid=25726) {result}")
    assert RESULT_LINE.match(ANSI.sub("", f"\x1b[36m(digits-mlp, pid=25726)\x1b[0m {result}"))
    assert not RESULT_LINE.match(f"(digits-mlp, pid=25726) (RayTrainWorker pid=26135) {result}")
    assert not RESULT_LINE.match(f"(RayTrainWorker pid=26135) {result}")
    assert not RESULT_LINE.match(f"\r(pid=14686) Running Dataset\r{result}")
