"""Property-based fuzzing of the gateway with Schemathesis, bounded: its OpenAPI document describes what it really
accepts and answers (status codes, content types, response schemas), no request reaches a 5xx but the declared
503 of a model without a live worker, and every error is OpenAI's error object. `python -m bench.lab.fuzz` runs the
same with many more examples (bench/lab/fuzz.py, which also says which checks are narrowed and why)."""

from __future__ import annotations

import json

import pytest

from bench.lab import fuzz

EXAMPLES = 50  # random cases per operation, valid and invalid, beside the examples and boundary values


@pytest.fixture(scope="module")
def target(redis_url):
    with fuzz.gateway(redis_url) as target:
        yield target


@pytest.fixture(scope="module")
def api_schema(target):
    return fuzz.load_schema(target)


def test_the_gateway_behaves_as_its_openapi_document_says(target):
    report = fuzz.fuzz(target, EXAMPLES, seed=1)
    assert report.cases > 250
    assert not report.failures, "\n\n".join(report.examples)


def test_bad_query_parameters_are_an_openai_400(target, api_schema):
    response = api_schema["/v1/batches"]["GET"].Case(query={"limit": "abc"}, headers=target.headers).call()
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "limit"


@pytest.mark.parametrize(("method", "path", "allowed"), [("DELETE", "/v1/models", "GET"),
                                                       ("PUT", "/v1/batches", "GET, POST")])
def test_an_undeclared_method_is_an_openai_405_naming_every_allowed_one(target, api_schema, method, path, allowed):
    response = api_schema[path]["GET"].Case(headers=target.headers).call(method=method)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == [allowed]
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_batch_from_upload_to_cancel_answers_as_documented(target, api_schema):
    """The fuzzer rarely makes a batch (it needs an uploaded file's id): the documented objects, made on purpose."""
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": fuzz.MODEL, "prompt": "hi"}})

    def call(method: str, path: str, **kwargs):
        case = api_schema[path][method].Case(headers=target.headers, **kwargs)
        response = case.call()
        case.validate_response(response)  # status code, content type and body as the document says
        assert response.status_code == 200, response.text
        return response.json() if path != "/v1/files/{file_id}/content" else response.text

    file = call("POST", "/v1/files", body={"file": line.encode(), "purpose": "batch"}, media_type="multipart/form-data")
    assert call("GET", "/v1/files/{file_id}", path_parameters={"file_id": file["id"]}) == file
    assert call("GET", "/v1/files/{file_id}/content", path_parameters={"file_id": file["id"]}) == line
    batch = call("POST", "/v1/batches", body={"input_file_id": file["id"], "endpoint": "/v1/completions",
                                              "completion_window": "24h", "metadata": {"run": "fuzz"}})
    assert call("GET", "/v1/batches/{batch_id}", path_parameters={"batch_id": batch["id"]})["status"] == "validating"
    assert batch["id"] in [b["id"] for b in call("GET", "/v1/batches", query={"limit": 100})["data"]]
    cancelled = call("POST", "/v1/batches/{batch_id}/cancel", path_parameters={"batch_id": batch["id"]})
    assert cancelled["status"] == "cancelling"
