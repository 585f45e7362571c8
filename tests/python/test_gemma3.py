"""The parity's Gemma-3 decoder (managedkv.gemma3, docs/python.md "Parity"), checked without
transformers: its parameters carry transformers' Gemma3ForCausalLM names and shapes, the loader
refuses what does not fit, a sliding layer reads exactly its window and a full layer everything,
and the norms scale by 1 + weight. Run by ctest (mkv_python.gemma3_selfcheck) with PYTHONPATH at
the build's python/ folder; the paged parity itself is mkv_python.parity_tiny_gemma3_cpu, and on
the GPU machine the same loader receives transformers' own state_dict()."""

import unittest

import torch

from managedkv import gemma3, parity

TINY = parity.GEMMA3_SIZES["tiny"]
CPU = torch.device("cpu")


class Gemma3LoaderTest(unittest.TestCase):
    def test_names_shapes_and_layer_types(self):
        names = [name for name, _ in gemma3.parameter_shapes(TINY)]
        self.assertEqual(len(names), 3 + 13 * TINY["layers"])
        self.assertIn("model.layers.2.self_attn.k_norm.weight", names)
        self.assertIn("model.layers.0.pre_feedforward_layernorm.weight", names)
        shapes = dict(gemma3.parameter_shapes(TINY))
        self.assertEqual(shapes["model.layers.0.self_attn.q_norm.weight"], (TINY["head_dim"],))
        self.assertEqual(shapes["model.layers.0.self_attn.k_proj.weight"], (2 * 16, 64))  # [out, in]
        self.assertEqual(gemma3.layer_types(TINY), [gemma3.SLIDING, gemma3.SLIDING, gemma3.FULL])
        model = gemma3.TinyGemma3.random(TINY, 0, CPU)
        self.assertEqual([model.layer_window(i) for i in range(3)], [TINY["window"], TINY["window"], None])

    def test_contract_errors(self):
        good = gemma3.random_state_dict(TINY, 0)
        self.assertEqual(len(gemma3.check_state_dict(good, TINY)), len(good))
        cases = {
            "missing ['lm_head.weight']": {k: v for k, v in good.items() if k != "lm_head.weight"},
            "unknown ['model.layers.0.self_attn.q_proj.bias']": dict(
                good, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
            ),
            "model.norm.weight: shape (65,)": dict(good, **{"model.norm.weight": torch.zeros(65)}),
            "model.norm.weight: dtype torch.float16": dict(good, **{"model.norm.weight": torch.zeros(64).half()}),
        }
        for needle, state in cases.items():
            with self.assertRaises(ValueError) as raised:
                gemma3.check_state_dict(state, TINY)
            self.assertIn(needle, str(raised.exception))


class Gemma3AttentionTest(unittest.TestCase):
    def setUp(self):
        self.model = gemma3.TinyGemma3.random(TINY, 0, CPU)
        generator = torch.Generator().manual_seed(3)
        self.length = 41
        self.q = torch.randn(1, TINY["heads"], TINY["head_dim"], generator=generator)
        self.k = torch.randn(self.length, TINY["kv_heads"], TINY["head_dim"], generator=generator)
        self.v = torch.randn(self.length, TINY["kv_heads"], TINY["head_dim"], generator=generator)
        self.position = torch.tensor([self.length - 1])

    def changed(self, layer, key):
        """Whether the output of `layer` at the last position moves when key `key` changes."""
        before = self.model.attend(layer, self.q, self.k, self.v, self.position)
        k = self.k.clone()
        k[key] += 5.0
        after = self.model.attend(layer, self.q, k, self.v, self.position)
        return not torch.equal(before, after)

    def test_a_sliding_layer_reads_exactly_its_window(self):
        first = self.length - TINY["window"]  # keys q - window < k <= q
        self.assertFalse(self.changed(0, first - 1))
        self.assertTrue(self.changed(0, first))
        self.assertTrue(self.changed(0, self.length - 1))

    def test_a_full_layer_reads_every_position(self):
        self.assertTrue(self.changed(2, 0))

    def test_norms_scale_by_one_plus_weight(self):
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
        plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + gemma3.RMS_NORM_EPS)
        self.assertTrue(torch.equal(self.model.rms_norm(x, torch.zeros(64)), plain))
        self.assertTrue(torch.allclose(self.model.rms_norm(x, torch.ones(64)), 2 * plain))


class KlProtocolTest(unittest.TestCase):
    """parity.compare_kl, the bf16 judge, measures what it names: 0 when the decode's logits are
    the re-prefill's, above the threshold when the decode ran another model."""

    def decoded(self, model, prompt, steps):
        seq = parity.Sequence("s", prompt, steps)
        tokens = list(prompt)
        for _ in range(steps):
            logits = model.forward_dense(tokens)
            seq.logits[len(tokens) - 1] = logits[-1]
            token = int(torch.multinomial(torch.softmax(logits[-1], -1), 1, generator=self.generator))
            seq.generated.append(token)
            tokens.append(token)
        return seq

    def setUp(self):
        self.generator = torch.Generator().manual_seed(11)

    def test_identical_logits_score_zero_and_another_model_fails(self):
        model = gemma3.TinyGemma3.random(TINY, 0, CPU)
        prompt = list(range(1, 40))
        same = parity.compare_kl(model.forward_dense, [self.decoded(model, prompt, 8)])
        self.assertEqual(same["kl_k3"], 0.0)
        self.assertEqual(same["tokens_scored"], 8)
        other = gemma3.TinyGemma3.random(TINY, 1, CPU)
        differ = parity.compare_kl(model.forward_dense, [self.decoded(other, prompt, 8)])
        self.assertGreater(differ["kl_k3"], parity.KL_THRESHOLD)


if __name__ == "__main__":
    unittest.main()
