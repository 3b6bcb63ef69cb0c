import numpy as np

import k3jax


def test_tiny_forward_and_generate(tiny_model):
    # The session's float32 k3-tiny (from_pretrained("k3-tiny", dtype="float32")) at shapes other
    # tests compile too: the forward at [2, 37] (test_layers, test_decode_consistency), generate of
    # one 3-token prompt for 6 tokens (test_generate); a worker that ran those reuses the programs.
    model = tiny_model("k3-tiny")
    logits = model(np.arange(2 * 37).reshape(2, 37) % model.cfg.vocab_size)
    assert logits.shape == (2, 37, model.cfg.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()
    out = k3jax.generate(model, [[5, 17, 3]], max_new_tokens=6)
    assert out.shape == (1, 6)
