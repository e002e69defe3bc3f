"""Training on real text through the index manifest that tasks.index writes."""
import json

import pytest

from gpt.config import Config, ConfigError
from gpt.train import load_datasets
from tests.fixtures_gpt import SMALL, read_metrics


@pytest.fixture(scope="module")
def shakespeare_index(shakespeare_jsonl, bpe_vocab, tmp_path_factory):
    from tasks.index import build_indices
    from tasks.tokenize.stage import tokenize
    out = tmp_path_factory.mktemp("gpt-index")
    vocab, merges = bpe_vocab
    tok = tokenize([str(shakespeare_jsonl)], str(out / "plays"), vocab_file=str(vocab), merge_file=str(merges), workers=1)
    config = Config(**{**SMALL, "mock_data": False, "vocab_size": tok.vocab_size, "train_iters": 40})
    index = build_indices([tok.prefixes["text"]], seq_length=config.seq_length, seed=config.seed,
                          num_samples=config.num_samples(), out_dir=str(out / "index"))
    return index.path, tok.vocab_size


def test_loss_falls_on_real_text(shakespeare_index, gpt_launcher, tmp_path):
    path, vocab = shakespeare_index
    run_dir = tmp_path / "run"
    cfg = {**SMALL, "mock_data": False, "data_index": path, "vocab_size": vocab, "train_iters": 40,
           "eval_interval": 20, "log_interval": 10}
    out = gpt_launcher.run({**cfg, "run_dir": str(run_dir)})
    losses = [r["lm_loss"] for r in read_metrics(run_dir)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    valid = read_metrics(run_dir, "valid")
    assert [r["iteration"] for r in valid] == [20, 40] and valid[1]["valid_loss"] < valid[0]["valid_loss"]
    assert json.loads(out.strip().splitlines()[-1])["status"] == "completed"


def test_index_that_does_not_fit_the_run_is_refused(shakespeare_index):
    path, vocab = shakespeare_index
    base = {**SMALL, "mock_data": False, "data_index": path, "vocab_size": vocab}
    with pytest.raises(ConfigError, match=r"the train split holds \d+ samples but the run needs 8000000"):
        load_datasets(Config(**{**base, "train_iters": 1_000_000}))
    with pytest.raises(ConfigError, match="was built for seq_length=16 but seq_length=32"):
        load_datasets(Config(**{**base, "train_iters": 40, "seq_length": 32}))
