"""gpt.memory's estimate of one rank's peak, term by term (benchmarks.memory checks it against
measured peaks)."""
from gpt.config import Config
from gpt.memory import STATE_BYTES, rank_memory

BASE = {"model": "gpt3-125m", "seq_length": 256, "micro_batch_size": 2, "global_batch_size": 8, "mock_data": True,
        "precision": "fp32", "vocab_size": 50257}


def test_fsdp_shards_the_state_and_counts_what_it_gathers_whole():
    ddp = rank_memory(Config.from_dict({**BASE, "data_parallel_mode": "ddp"}), 2)
    fsdp = rank_memory(Config.from_dict({**BASE, "data_parallel_mode": "fsdp"}), 2)
    h = 768
    block, root = 12 * h * h + 13 * h, 50304 * h + 256 * h + 2 * h   # embedding, positions (the sequence), final norm
    assert ddp.parameters == fsdp.parameters == 12 * block + root
    assert (ddp.model_state, ddp.unsharded) == (STATE_BYTES * ddp.parameters, 0)
    assert fsdp.model_state == ddp.model_state // 2
    assert fsdp.unsharded == 8 * (block + root)    # fp32 weights and gradients: one block, and the root for the step
    assert fsdp.activations == ddp.activations and fsdp.loss == ddp.loss


def test_pipeline_schedules_hold_their_micro_batches_in_flight():
    one_f_one_b = rank_memory(Config.from_dict({**BASE, "pipeline_parallel": 2}), 2)
    gpipe = rank_memory(Config.from_dict({**BASE, "pipeline_parallel": 2, "pipeline_schedule": "gpipe"}), 2)
    # The last stage, with the output layer, is the heavier: 1F1B runs one micro-batch through it at a
    # time, GPipe all four forwards before any backward.
    assert (one_f_one_b.stage, one_f_one_b.in_flight) == ("the last stage", 1)
    assert (gpipe.stage, gpipe.in_flight) == ("the last stage", 4)
    assert gpipe.activations == 4 * one_f_one_b.activations
