"""The Qwen3-Next decoder of the parity (managedkv.qwen3_next) and what its hybrid parity can catch:
the loader's names and errors; a linear-attention layer resumed from its carried state equals the
layer run whole, and a lost state changes it; the hybrid parity fails when the library's restore of
the recurrent rows, or of a checkpoint's partial page, is taken away; the --reference transformers
code path on a stub standing in for transformers."""

import json
import os
import sys
import tempfile
import types
import unittest

import torch

from managedkv import engine, parity, qwen3_next

TINY = parity.HYBRID_SIZES["tiny"]
STUB_VERSION = "0+managedkv-test-stub (not transformers)"


def run_parity(extra=(), transformers_module="absent"):
    """parity.main for --model hybrid; returns (exit status, report or None)."""
    saved = sys.modules.get("transformers", "absent")
    if transformers_module != "absent":
        sys.modules["transformers"] = transformers_module
    try:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "parity.json")
            status = parity.main(["--model", "hybrid", "--device", "cpu", "--json", path, *extra])
            report = None
            if os.path.exists(path):
                with open(path) as file:
                    report = json.load(file)
    finally:
        if saved == "absent":
            sys.modules.pop("transformers", None)
        else:
            sys.modules["transformers"] = saved
    return status, report


class LoaderTest(unittest.TestCase):
    def test_layer_pattern_and_names(self):
        self.assertEqual(qwen3_next.layer_types(TINY), ["linear_attention", "full_attention"] * 2)
        names = [name for name, _ in qwen3_next.parameter_shapes(TINY)]
        self.assertIn("model.layers.0.linear_attn.in_proj_qkvz.weight", names)
        self.assertIn("model.layers.1.self_attn.q_proj.weight", names)
        self.assertNotIn("model.layers.0.self_attn.q_proj.weight", names)
        shapes = dict(qwen3_next.parameter_shapes(TINY))
        # q_proj carries a query and an output gate per head.
        self.assertEqual(shapes["model.layers.1.self_attn.q_proj.weight"], (2 * 4 * 16, 64))
        self.assertEqual(shapes["model.layers.0.linear_attn.conv1d.weight"], (2 * 32 + 64, 1, 4))

    def test_loader_errors_name_what_is_wrong(self):
        state = qwen3_next.random_state_dict(TINY, 0)
        del state["model.layers.0.linear_attn.A_log"]
        with self.assertRaisesRegex(ValueError, "missing.*A_log"):
            qwen3_next.TinyQwen3Next(TINY, state, torch.device("cpu"))
        state = qwen3_next.random_state_dict(TINY, 0)
        state["model.layers.2.linear_attn.out_proj.weight"] = torch.zeros(64, 63)
        with self.assertRaisesRegex(ValueError, "out_proj.weight: shape"):
            qwen3_next.TinyQwen3Next(TINY, state, torch.device("cpu"))
        state = qwen3_next.random_state_dict(TINY, 0)
        state["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(2, 2)
        with self.assertRaisesRegex(ValueError, "unknown.*experts"):
            qwen3_next.TinyQwen3Next(TINY, state, torch.device("cpu"))


class StateTest(unittest.TestCase):
    def setUp(self):
        self.model = qwen3_next.TinyQwen3Next.random(TINY, 0, torch.device("cpu"))
        tokens = torch.randint(1, TINY["vocab"], (50,), generator=torch.Generator().manual_seed(3))
        self.h = self.model.embed_tokens(tokens)

    def test_a_resumed_layer_equals_the_layer_run_whole(self):
        whole = self.model.mix(0, self.h, *self.model.zero_state())
        memory, conv = self.model.zero_state()
        parts = [self.model.mix(0, self.h[a:b], memory, conv) for a, b in ((0, 1), (1, 23), (23, 24), (24, 50))]
        self.assertLess(float((torch.cat(parts) - whole).abs().max()), 1e-5)
        # The conv window holds the last kernel - 1 inputs; the memory is not zero.
        self.assertEqual(tuple(conv.shape), (TINY["linear_key_heads"] * 32 + 64, 3))
        self.assertGreater(float(memory.abs().max()), 0.0)

    def test_a_lost_state_changes_the_output(self):
        whole = self.model.mix(0, self.h, *self.model.zero_state())
        restarted = self.model.mix(0, self.h[30:], *self.model.zero_state())
        self.assertGreater(float((restarted - whole[30:]).abs().max()), 1e-2)
        memory, conv = self.model.zero_state()
        self.model.mix(0, self.h[:30], memory, conv)
        conv.zero_()  # the conv window alone lost
        without_window = self.model.mix(0, self.h[30:], memory, conv)
        self.assertGreater(float((without_window - whole[30:]).abs().max()), 1e-2)


class SabotageTest(unittest.TestCase):
    """The hybrid parity must fail when a resumed row does not get what the library restores."""

    def sabotaged_parity(self, damage):
        original = engine.PagedEngine.forward
        damaged = set()

        def forward(paged, rows, new_tokens):
            for row in rows:
                resumed = row.seq.reused > 0 and row.kv_length == row.seq.reused
                if resumed and id(row.seq) not in damaged:
                    damaged.add(id(row.seq))
                    damage(paged, row)
            return original(paged, rows, new_tokens)

        engine.PagedEngine.forward = forward
        try:
            status, report = run_parity()
        finally:
            engine.PagedEngine.forward = original
        self.assertTrue(damaged, "no row resumed: the sabotage never ran")
        return status, report

    def test_zeroed_recurrent_rows_fail_the_parity(self):
        def zero_rows(paged, row):
            for state, kind in paged.layers:
                if kind is None:
                    state[0][row.resident.slot].zero_()
                    state[1][row.resident.slot].zero_()

        status, report = self.sabotaged_parity(zero_rows)
        self.assertEqual(status, 1)
        self.assertFalse(report["passed"])

    def test_a_lost_partial_page_fails_the_parity(self):
        def zero_partial_page(paged, row):
            valid = row.kv_length % paged.page
            if valid == 0:
                return
            page = paged.runtime.fullPageTable().entry(row.resident.slot, row.kv_length // paged.page)
            for cache, kind in paged.layers:
                if kind is not None:
                    cache[:, page, :valid].zero_()

        status, report = self.sabotaged_parity(zero_partial_page)
        self.assertEqual(status, 1)
        self.assertFalse(report["passed"])

    def test_the_untouched_parity_passes(self):
        status, report = run_parity()
        self.assertEqual(status, 0)
        self.assertGreater(report["restored_checkpoints"], 0)
        self.assertTrue(all(not p["failed_guards"] for p in report["paths"].values()))


def stub_transformers():
    """A module with transformers' Qwen3-Next names over the engine's own decoder: the config keeps
    RoPE in rope_parameters as transformers 5 does; the model holds its weights as parameters under
    transformers' names (so load_state_dict(strict=True) and state_dict() behave as transformers')."""
    module = types.ModuleType("transformers")
    module.__version__ = STUB_VERSION

    class Qwen3NextConfig:
        def __init__(self, rope_parameters=None, **kwargs):
            self.__dict__.update(kwargs)
            self.rope_parameters = rope_parameters
            self._attn_implementation = None

    class Rotary(torch.nn.Module):
        def __init__(self, dim, theta):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    class Qwen3NextForCausalLM(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            rope = config.rope_parameters
            self.model = torch.nn.Module()
            self.model.rotary_emb = Rotary(int(config.head_dim * rope["partial_rotary_factor"]), rope["rope_theta"])
            for name, shape in qwen3_next.parameter_shapes(TINY):
                owner = self
                *path, leaf = name.split(".")
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, torch.nn.Module())
                    owner = getattr(owner, part)
                owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))

        def forward(self, input_ids=None, use_cache=None):
            assert use_cache is False
            decoder = qwen3_next.TinyQwen3Next(TINY, self.state_dict(), input_ids.device)
            return types.SimpleNamespace(logits=decoder.forward_dense(input_ids[0].tolist())[None])

    module.Qwen3NextConfig = Qwen3NextConfig
    module.Qwen3NextForCausalLM = Qwen3NextForCausalLM
    return module


class TransformersPathTest(unittest.TestCase):
    def test_transformers_code_path_on_a_stub(self):
        status, report = run_parity(["--reference", "transformers"], stub_transformers())
        self.assertEqual(status, 0)
        self.assertEqual(report["transformers"], STUB_VERSION)
        config = report["transformers_config"]
        self.assertEqual(config["layer_types"], qwen3_next.layer_types(TINY))
        self.assertEqual(config["partial_rotary_factor"], 0.25)
        self.assertTrue(config["inv_freq_equals_default"])
        self.assertFalse(config["delta_rule_fast_path"])
        self.assertGreater(report["restored_checkpoints"], 0)

    def test_transformers_missing(self):
        status, report = run_parity(["--reference", "transformers"], None)
        self.assertEqual(status, 2)
        self.assertIsNone(report)


if __name__ == "__main__":
    unittest.main()
