"""The MiniLM encoder and the /v1/embeddings endpoint."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from quicksilver.api.embeddings import router
from quicksilver.embeddings import DIM, MODEL_NAME, get_embedder

# First 8 dimensions of the sentence vectors computed by HF transformers' BertModel on the same weights
# (mean pooling over the attention mask + L2 normalisation, as sentence-transformers does), recorded once.
REFERENCE = {
    "A man is eating food.": [0.03324, 0.00441, -0.00628, 0.04838, -0.1387, -0.03362, 0.10113, -0.05438],
    "Diffusion models denoise a canvas of masks.": [0.01829, -0.04666, 0.07747, 0.00766, 0.02737, -0.08003,
                                                    0.0421, -0.12162],
}


@pytest.fixture(scope="module")
def embedder():
    return get_embedder()


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


def test_matches_reference_implementation(embedder):
    vectors = embedder.embed(list(REFERENCE))
    assert vectors.shape == (2, DIM) and vectors.dtype == np.float32
    for vec, ref in zip(vectors, REFERENCE.values(), strict=True):
        np.testing.assert_allclose(vec[:8], ref, atol=2e-4)


def test_unit_norm_and_paraphrase_closer_than_unrelated(embedder):
    a, b, c = embedder.embed(["A man is eating food.", "Someone is having a meal.", "The stock market fell today."])
    np.testing.assert_allclose([np.linalg.norm(v) for v in (a, b, c)], 1.0, atol=1e-5)
    assert a @ b > 0.5 > max(a @ c, b @ c)


def test_batching_and_padding_do_not_change_vectors(embedder):
    texts = ["short", "a much longer sentence about lighthouses and ferries that pads the batch " * 5, "tiny"]
    together = embedder.embed(texts)
    alone = np.stack([embedder.embed(t) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_long_input_is_truncated_not_rejected(embedder):
    assert embedder.token_counts(["word " * 2000])[0] == embedder.max_length
    assert np.isfinite(embedder.embed("word " * 2000)).all()


def test_endpoint_float_shape_and_usage(client, embedder):
    r = client.post("/v1/embeddings", json={"input": ["hello world", "glass bees"], "model": MODEL_NAME})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL_NAME
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == DIM for d in body["data"])
    expected_tokens = sum(embedder.token_counts(["hello world", "glass bees"]))
    assert body["usage"] == {"prompt_tokens": expected_tokens, "total_tokens": expected_tokens}
    np.testing.assert_allclose(body["data"][1]["embedding"], embedder.embed("glass bees"), atol=1e-6)


def test_endpoint_base64_and_single_string_and_token_ids(client, embedder):
    r = client.post("/v1/embeddings", json={"input": "hello world", "model": "sentence-transformers/all-MiniLM-L6-v2",
                                            "encoding_format": "base64"})
    assert r.status_code == 200
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, embedder.embed("hello world"), atol=1e-6)
    ids = embedder.encode_ids(["hello world"])[0]
    r = client.post("/v1/embeddings", json={"input": ids, "model": MODEL_NAME})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], vec, atol=1e-6)


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"input": "x"}, 400, "model"),
        ({"input": "", "model": MODEL_NAME}, 400, "input"),
        ({"input": [], "model": MODEL_NAME}, 400, "input"),
        ({"input": "x", "model": "text-embedding-3-small"}, 404, "model"),
        ({"input": "x", "model": MODEL_NAME, "temperature": 1}, 400, "temperature"),
        ({"input": "x", "model": MODEL_NAME, "encoding_format": "hex"}, 400, "encoding_format"),
        ({"input": "x", "model": MODEL_NAME, "dimensions": 128}, 400, "dimensions"),
        ({"input": [[1, 2], [99999999]], "model": MODEL_NAME}, 400, "input"),
        ({"input": [{"a": 1}], "model": MODEL_NAME}, 400, "input"),
        ({"input": [True, False], "model": MODEL_NAME}, 400, "input"),  # not token ids (were read as 1, 0)
        ({"input": [[101, 2.0]], "model": MODEL_NAME}, 400, "input"),
    ],
)
def test_endpoint_errors_use_openai_envelope(client, body, status, param):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_endpoint_rejects_non_json(client):
    r = client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_endpoint_rejects_lone_surrogates(client):
    """A JSON "\\ud800" escape without its pair is not text a tokenizer can read: a 400 naming the input, not a 500."""
    r = client.post("/v1/embeddings", content=f'{{"model": "{MODEL_NAME}", "input": ["ok", "a\\ud800"]}}'.encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input[1]" and "Unicode" in err["message"]
    assert client.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "ok \U0001f600"}).status_code == 200
