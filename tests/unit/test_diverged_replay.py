"""A divergence is recorded in run.dir/diverged.json and a start that would replay it (same
config up to layout and reporting, from a checkpoint no later than the diverged step) is
refused with exit 3, as torch's elastic agent would otherwise restart it up to --max-restarts
times."""

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from configs import tiny_config
from moepar import launch
from moepar.rundir import DIVERGED_FILE, RunDirError
from moepar.train import NonFiniteError, ReplayRefused, Trainer
from test_faults_run import config_file, poison_from, quiet


def steps_logged(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_divergence_before_any_checkpoint_is_not_started_over(tmp_path, capsys):
    """eps=0 makes NaN weights in the update of step 1 (test_faults_run): exit 3, recorded;
    the elastic restart's start (run.resume=auto, same config) is refused at once."""
    run_dir = tmp_path / "run"
    cfg = config_file(tmp_path, run_dir, "--train.steps=4", "--train.eps=0")
    assert launch.main([cfg]) == launch.EXIT_DIVERGED
    record = json.loads((run_dir / DIVERGED_FILE).read_text())
    assert record["step"] == 1 and "made parameters non-finite" in record["reason"]
    assert record["config"]["train"]["eps"] == 0
    capsys.readouterr()
    assert launch.main([cfg, "--run.resume=auto", "--parallel.timeout_s=77"]) == launch.EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "not retrying a divergence: starting over with the same config would replay step 1" \
        in err, err
    assert steps_logged(run_dir) == [1]                   # nothing ran
    # What the advice says: change eps and start again over the old run.
    assert launch.main([cfg, "--train.eps=1e-8", "--run.overwrite=true"]) == 0
    assert not (run_dir / DIVERGED_FILE).exists() and steps_logged(run_dir) == [1, 2, 3, 4]


def test_a_resume_before_the_diverged_step_is_refused_unless_the_config_changes(tmp_path):
    base = ["--train.steps=8", "--run.checkpoint_every=1", "--run.keep_checkpoints=0",
            "--train.max_skipped_steps=2"]
    trainer = Trainer(tiny_config(tmp_path, *base), log=quiet)
    poison_from(trainer, 3)
    with pytest.raises(NonFiniteError, match="step 5"):
        trainer.run()
    assert json.loads((tmp_path / DIVERGED_FILE).read_text())["step"] == 5
    # The same run resumed (step 4), also with other reporting: the same steps again.
    for extra in ([], ["--run.log_every=3"]):
        with pytest.raises(ReplayRefused, match="resuming from step 4 with the same config "
                                                "would replay step 5"):
            Trainer(tiny_config(tmp_path, *base, "--run.resume=true", *extra), log=quiet)
    # Asking to overwrite later checkpoints does not drop the record of a resume (an elastic
    # job restarts with the same flags); only a fresh start over the old run does.
    with pytest.raises(ReplayRefused):
        Trainer(tiny_config(tmp_path, *base, "--run.resume=true", "--run.overwrite=true"),
                log=quiet)
    assert (tmp_path / DIVERGED_FILE).exists()
    # A changed optimization, or bad-step policy, is another attempt: it resumes.
    for extra in (["--train.lr=1e-3", "--run.allow_changes=train.lr"],
                  ["--train.max_skipped_steps=5"]):
        resumed = Trainer(tiny_config(tmp_path, *base, "--run.resume=true", *extra), log=quiet)
        assert resumed.step == 4
        resumed.release()
    # A checkpoint after the diverged step (a run that went on) is not a replay.
    (tmp_path / DIVERGED_FILE).write_text(json.dumps(
        {"step": 3, "reason": "r", "config": json.loads(json.dumps(trainer.cfg, default=vars))}))
    Trainer(tiny_config(tmp_path, *base, "--run.resume=true"), log=quiet).release()


def test_an_unreadable_record_is_named(tmp_path):
    Trainer(tiny_config(tmp_path, "--train.steps=1"), log=quiet).run()
    (tmp_path / DIVERGED_FILE).write_text("{not json")
    with pytest.raises(RunDirError, match=f"{DIVERGED_FILE} is unreadable"):
        Trainer(tiny_config(tmp_path, "--train.steps=2", "--run.resume=true"), log=quiet)


def test_workers_stopped_by_the_agent_do_not_hide_the_code_of_the_one_that_failed(monkeypatch):
    """torch's agent SIGTERMs the other workers once one exits: exit 3 and -15 make 3, not 1."""
    def failing_run(args):
        raise ChildFailedError("moepar", {0: ProcessFailure(0, 11, 3, "<N/A>"),
                                          1: ProcessFailure(1, 12, -15, "<N/A>")})
    monkeypatch.setattr("torch.distributed.run.run", failing_run)
    assert launch.launch(2, ["train", "x.toml"]) == launch.EXIT_DIVERGED

    def mixed(args):
        raise ChildFailedError("moepar", {0: ProcessFailure(0, 11, 3, "<N/A>"),
                                          1: ProcessFailure(1, 12, 2, "<N/A>")})
    monkeypatch.setattr("torch.distributed.run.run", mixed)
    assert launch.launch(2, ["train", "x.toml"]) == launch.EXIT_FAILED
