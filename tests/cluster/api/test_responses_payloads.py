"""A Responses request as the chat request it becomes (``cluster.api.responses_payloads``):
text parts joined as the chat route joins them, and the fields that would change the output
but are not supported refused with a 400 naming them."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.api.api_errors import APIError
from cluster.api.openai_payloads import chat_payload
from cluster.api.responses_models import ResponsesRequest
from cluster.api.responses_payloads import chat_request, check_request, input_items


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def test_input_text_parts_of_a_message_are_joined_by_newlines() -> None:
    parts = [{"type": "input_text", "text": "ab"}, {"type": "input_text", "text": "cd"}]
    req = _request(input=[{"role": "user", "content": parts}])
    chat = chat_request(req, input_items(req.input))
    assert chat.messages[0].model_dump(exclude_none=True)["content"] == "ab\ncd"


def test_a_refusal_part_adds_no_line() -> None:
    parts = [{"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "ok"}]
    req = _request(input=[{"role": "assistant", "content": parts}])
    chat = chat_request(req, input_items(req.input))
    assert chat.messages[0].model_dump(exclude_none=True)["content"] == "ok"


def test_an_error_names_the_index_in_this_requests_input_after_a_stored_history() -> None:
    """With ``previous_response_id`` the stored conversation comes first; an error still names
    the item's place in the request's own ``input``, as without one."""
    history = [{"type": "message", "role": "user", "content": "first"},
               {"type": "message", "role": "assistant", "content": "ok"}]  # fmt: skip
    req = _request(input=[{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}])
    for items, num_history in ((input_items(req.input), 0), (history + input_items(req.input), 2)):
        with pytest.raises(APIError) as info:
            chat_request(req, items, num_history)
        assert info.value.param == "input.1.role", info.value.message


def _refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        check_request(_request(**fields))
    assert info.value.status == 400
    return info.value


def test_chat_template_kwargs_go_to_the_chat_request_as_vllm_takes_them() -> None:
    kwargs = {"enable_thinking": False}
    req = _request(chat_template_kwargs=kwargs)
    check_request(req)
    chat = chat_request(req, input_items(req.input))
    assert chat_payload(chat).chat_template_kwargs == kwargs
    refused = _request(chat_template_kwargs={"chat_template": "{{ x }}"})
    with pytest.raises(APIError) as info:
        chat_payload(chat_request(refused, input_items(refused.input)))
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")


def test_output_text_logprobs_are_refused_like_top_logprobs() -> None:
    error = _refused(include=["reasoning.encrypted_content", "message.output_text.logprobs"])
    assert error.param == "include.1"
    assert "logprobs are not returned" in error.message
    check_request(_request(include=["reasoning.encrypted_content"]))  # changes nothing


def test_include_holds_openais_values_only() -> None:
    """As OpenAI (and vLLM) answer: an unknown value is a 400 naming its place and the values
    allowed; those of tools not served here are accepted and add nothing."""
    error = _refused(include=["file_search_call.results", "reasoning.summary"])
    assert error.param == "include.1"
    assert "'reasoning.summary' is not one of" in error.message
    assert "code_interpreter_call.outputs" in error.message
    for bad in ("reasoning.encrypted_content", {"a": 1}, 3):
        assert _refused(include=bad).param == "include"
    assert _refused(include=[None]).param == "include.0"
    check_request(
        _request(include=["web_search_call.action.sources", "code_interpreter_call.outputs"])
    )
    check_request(_request(include=[]))
    check_request(_request(include=None))


@pytest.mark.parametrize(
    ("name", "value"),
    [("include_reasoning", False), ("vllm_xargs", {"a": 1}), ("mm_processor_kwargs", {"a": 1}),
     ("kv_transfer_params", {"do_remote_decode": True}),
     # an off value of another type is another value (1 is not true, 0 is not false)
     ("include_reasoning", 1), ("background", 0), ("background", True)],
)  # fmt: skip
def test_vllm_fields_that_change_the_output_are_refused(name: str, value: Any) -> None:
    assert _refused(**{name: value}).param == name


@pytest.mark.parametrize(
    ("name", "value"),
    [("include_reasoning", True), ("priority", 0), ("vllm_xargs", {}), ("background", False),
     ("background", None), ("conversation", None)],
)  # fmt: skip
def test_their_off_values_are_accepted(name: str, value: Any) -> None:
    check_request(_request(**{name: value}))


def test_priority_goes_to_the_chat_request_as_on_the_chat_route() -> None:
    req = _request(priority=-4)
    check_request(req)
    assert chat_request(req, [{"role": "user", "content": "hi"}]).priority == -4


@pytest.mark.parametrize(("status", "continues"),
                         [("incomplete", True), ("in_progress", True), ("completed", False),
                          (None, False)])  # fmt: skip
def test_a_partial_assistant_message_last_is_continued(status: str | None, continues: bool) -> None:
    """vLLM's partial message completion: a response cut off (``incomplete``) sent back as the
    last input item is continued, not answered by a new turn."""
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "1, 2, 3,"}]}  # fmt: skip
    if status is not None:
        answer["status"] = status
    req = _request(input=[{"role": "user", "content": "Count to 10"}, answer])
    payload = chat_payload(chat_request(req, input_items(req.input)))
    assert (payload.continue_final_message, payload.add_generation_prompt) == (
        continues, not continues)  # fmt: skip
    assert payload.messages[-1]["content"] == "1, 2, 3,"
    # A user's message last opens the reply's turn whatever its status says.
    asked = _request(input=[{"role": "user", "content": "Hi", "status": "incomplete"}])
    assert chat_payload(chat_request(asked, input_items(asked.input))).add_generation_prompt


def test_a_bad_tool_field_is_a_400_naming_it() -> None:
    req = _request(tools=[{"type": "function", "name": "f", "strict": "yes"}])
    with pytest.raises(APIError) as info:
        chat_request(req, input_items(req.input))
    assert (info.value.status, info.value.param) == (400, "tools.0.strict")


def test_a_reasoning_effort_out_of_range_is_400_naming_reasoning_effort() -> None:
    req = _request(reasoning={"effort": "bogus"})
    with pytest.raises(APIError) as info:
        chat_request(req, input_items(req.input))
    assert info.value.param == "reasoning.effort", info.value.message
