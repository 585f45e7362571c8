"""The parity's weights under transformers' Llama names, checked without transformers (docs/python.md,
"Parity against transformers"): the loader's contract, the decoder the paged engine runs against
transformers' Llama forward re-implemented in torch (managedkv.hf_llama.ReferenceLlamaForCausalLM),
the whole parity against that stand-in (--reference hf-torch), and the --reference transformers
code path on a stub module standing in for transformers (the JSON then names the stub's version),
or with transformers missing. Run by ctest (mkv_python.hf_llama_selfcheck) with PYTHONPATH at the
build's python/ folder; on the GPU machine the same loader receives transformers' own state_dict()."""

import json
import os
import sys
import tempfile
import types
import unittest

import torch

from managedkv import hf_llama, parity

TINY = parity.SIZES["tiny"]
SMALL = parity.SIZES["small"]
STUB_VERSION = "0+managedkv-test-stub (not transformers)"


def reference_logits(geometry, state_dict, tokens):
    module = hf_llama.ReferenceLlamaForCausalLM(geometry)
    module.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        return module(torch.tensor([tokens]))[0]


def tokens(geometry, n, seed=7):
    return torch.randint(0, geometry["vocab"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class LoaderTest(unittest.TestCase):
    def test_names_and_shapes_are_transformers_llama(self):
        names = [name for name, _ in hf_llama.parameter_shapes(TINY)]
        self.assertEqual(names[0], "model.embed_tokens.weight")
        self.assertIn("model.layers.1.self_attn.k_proj.weight", names)
        self.assertIn("model.layers.0.post_attention_layernorm.weight", names)
        self.assertEqual(names[-2:], ["model.norm.weight", "lm_head.weight"])
        self.assertEqual(len(names), 3 + 9 * TINY["layers"])
        # The stand-in's own module tree gives exactly these names and shapes.
        own = hf_llama.ReferenceLlamaForCausalLM(TINY).state_dict()
        self.assertEqual({k: tuple(v.shape) for k, v in own.items()}, dict(hf_llama.parameter_shapes(TINY)))
        shapes = dict(hf_llama.parameter_shapes(TINY))
        self.assertEqual(shapes["model.layers.0.self_attn.k_proj.weight"], (2 * 16, 64))  # [out, in]
        self.assertEqual(shapes["model.layers.0.mlp.down_proj.weight"], (64, 128))

    def test_contract_errors(self):
        good = hf_llama.random_state_dict(TINY, 0)
        self.assertEqual(len(hf_llama.check_state_dict(good, TINY)), len(good))
        with_buffer = dict(good, **{"model.rotary_emb.inv_freq": torch.ones(8)})
        self.assertEqual(len(hf_llama.check_state_dict(with_buffer, TINY)), len(good))
        cases = {
            "missing ['lm_head.weight']": {k: v for k, v in good.items() if k != "lm_head.weight"},
            "unknown ['model.layers.0.self_attn.q_proj.bias']": dict(
                good, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
            ),
            "model.layers.1.mlp.up_proj.weight: shape (128, 32)": dict(
                good, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 32)}
            ),
            "model.norm.weight: dtype torch.float64": dict(good, **{"model.norm.weight": torch.ones(64).double()}),
        }
        for message, state in cases.items():
            with self.assertRaises(ValueError) as raised:
                parity.TinyLlama(TINY, state, torch.device("cpu"))
            self.assertIn(message, str(raised.exception))


class DecoderAgainstStandInTest(unittest.TestCase):
    """The decoder the paged engine runs, loaded from a state dict under transformers' names,
    against transformers' forward re-implemented in torch on the same state dict."""

    def test_dense_logits_equal_the_stand_in(self):
        for geometry in (TINY, SMALL, dict(TINY, rms_norm_eps=1e-5, rope_theta=500000.0)):
            state = hf_llama.random_state_dict(geometry, 3)
            sequence = tokens(geometry, 70)
            model = parity.TinyLlama(geometry, state, torch.device("cpu"))
            diff = float((model.forward_dense(sequence) - reference_logits(geometry, state, sequence)).abs().max())
            self.assertLessEqual(diff, 1e-5, geometry)

    def test_the_check_sees_convention_errors(self):
        """Each mistake a loader or a decoder could make moves the logits far past the tolerance."""
        state = hf_llama.random_state_dict(TINY, 3)
        sequence = tokens(TINY, 70)
        expected = reference_logits(TINY, state, sequence)
        cpu = torch.device("cpu")

        def diff(model):
            return float((model.forward_dense(sequence) - expected).abs().max())

        self.assertEqual(diff(parity.TinyLlama(TINY, state, cpu)), 0.0)
        q = "model.layers.0.self_attn.q_proj.weight"  # square in this geometry: shapes cannot tell
        self.assertGreater(diff(parity.TinyLlama(TINY, dict(state, **{q: state[q].t().contiguous()}), cpu)), 1e-2)
        norm = "model.layers.1.input_layernorm.weight"
        self.assertGreater(diff(parity.TinyLlama(TINY, dict(state, **{norm: torch.ones(64)}), cpu)), 1e-2)
        self.assertGreater(diff(parity.TinyLlama(dict(TINY, rope_theta=500000.0), state, cpu)), 1e-2)
        swapped = parity.TinyLlama(TINY, state, cpu)

        def interleaved_rope(x, positions):  # GPT-J's pairs (0, 1), (2, 3), ... instead of rotate_half
            angles = positions.float()[:, None] * swapped.inv_freq[None, :]
            cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)

        swapped.rope = interleaved_rope
        self.assertGreater(diff(swapped), 1e-2)


def stub_transformers():
    """A module with transformers' names over the stand-in: LlamaConfig keeps rope_theta in
    rope_parameters as transformers 5 does; LlamaForCausalLM(config)(input_ids=...).logits."""
    module = types.ModuleType("transformers")
    module.__version__ = STUB_VERSION

    class LlamaConfig:
        def __init__(self, attn_implementation=None, rope_theta=10000.0, **kwargs):
            self.__dict__.update(kwargs)
            self.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
            self._attn_implementation = attn_implementation

    class LlamaForCausalLM(hf_llama.ReferenceLlamaForCausalLM):
        def __init__(self, config):
            geometry = dict(
                vocab=config.vocab_size,
                hidden=config.hidden_size,
                layers=config.num_hidden_layers,
                heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                ffn=config.intermediate_size,
                rms_norm_eps=config.rms_norm_eps,
                rope_theta=config.rope_parameters["rope_theta"],
            )
            super().__init__(geometry)
            self.config = config

        def forward(self, input_ids=None, use_cache=None):
            assert use_cache is False
            return types.SimpleNamespace(logits=super().forward(input_ids))

    module.LlamaConfig = LlamaConfig
    module.LlamaForCausalLM = LlamaForCausalLM
    return module


class ParityTest(unittest.TestCase):
    def run_parity(self, reference, transformers_module="absent"):
        saved = sys.modules.get("transformers", "absent")
        if transformers_module != "absent":
            sys.modules["transformers"] = transformers_module  # None: import fails
        try:
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "parity.json")
                status = parity.main(["--model", "llama", "--device", "cpu", "--reference", reference, "--json", path])
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

    def test_hf_torch_reference_every_path(self):
        status, report = self.run_parity("hf-torch")
        self.assertEqual(status, 0)
        self.assertEqual(report["reference"], "hf-torch")
        self.assertNotIn("transformers", report)
        self.assertTrue(report["tokens_equal"])
        self.assertLessEqual(report["max_abs_logit_diff"], parity.LOGIT_TOLERANCE)
        self.assertEqual(
            set(report["paths"]),
            {"warm_reuse_chunked_join", "decode_written_hit", "eviction_then_miss", "host_tier_onboard"},
        )
        self.assertTrue(all(p["passed"] for p in report["paths"].values()))

    def test_transformers_code_path_on_a_stub(self):
        status, report = self.run_parity("transformers", stub_transformers())
        self.assertEqual(status, 0)
        self.assertEqual(report["reference"], "transformers")
        self.assertEqual(report["transformers"], STUB_VERSION)  # the JSON names what ran
        config = report["transformers_config"]
        self.assertEqual(config["attn_implementation"], "eager")
        self.assertEqual((config["rope_type"], config["rope_theta"]), ("default", 10000.0))
        self.assertTrue(config["inv_freq_equals_computed"])
        self.assertFalse(config["tie_word_embeddings"])
        self.assertTrue(report["hf_torch_vs_transformers"]["passed"])
        self.assertTrue(report["passed"])

    def test_transformers_missing(self):
        status, report = self.run_parity("transformers", None)
        self.assertEqual(status, 2)
        self.assertIsNone(report)

    def test_config_rope_across_versions(self):
        v5 = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        v4 = types.SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
        v4_scaled = types.SimpleNamespace(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0})
        self.assertEqual(hf_llama.config_rope(v5), ("default", 500000.0))
        self.assertEqual(hf_llama.config_rope(v4), ("default", 10000.0))
        self.assertEqual(hf_llama.config_rope(v4_scaled)[0], "linear")


if __name__ == "__main__":
    unittest.main()
