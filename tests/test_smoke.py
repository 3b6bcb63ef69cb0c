import numpy as np

import k3jax


def test_tiny_forward_and_generate():
    model = k3jax.from_pretrained("k3-tiny", dtype="float32")
    logits = model(np.arange(1, 6)[None])
    assert logits.shape == (1, 5, model.cfg.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()
    out = k3jax.generate(model, [[1, 2, 3]], max_new_tokens=4)
    assert out.shape == (1, 4)
