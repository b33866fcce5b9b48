"""The agent of treerl's built-in tool world (`treerl train agent_tools`): look a record up, answer one field.

Plain Python with the OpenAI SDK; nothing from treerl is imported. treerl calls `episode` with an
`openai.AsyncOpenAI` client pointed at its recording proxy and one task, a dict such as
{"question": "code of 7?", "id": 7, "answer": "q", "records": {"7": {"id": 7, "code": "q"}, ...}},
and trains on every model call the episode makes, with the reward it returns.
"""

import json

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "the record with this id",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}


async def episode(client, task: dict) -> float:
    """Call lookup, show the model the record, ask for the answer: 0.8 for the right field, 0.2 x how well
    the call was written (characters of the expected arguments matched, in order, over the longer length)."""
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=[LOOKUP], max_tokens=12,
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    reply = first.choices[0].message
    call = reply.tool_calls[0]
    try:
        record = task["records"].get(str(json.loads(call.function.arguments)["id"]))
    except (ValueError, TypeError, KeyError):
        record = None
    messages.append(reply.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps(record) if record else "error: no such record"})
    second = await client.chat.completions.create(
        model="policy", messages=messages, tools=[LOOKUP], tool_choice="none", max_tokens=4)
    expected = json.dumps({"id": task["id"]})
    written = call.function.arguments
    matched = next((i for i, (a, b) in enumerate(zip(written, expected)) if a != b), min(len(written), len(expected)))
    return 0.2 * matched / max(len(written), len(expected)) + 0.8 * (second.choices[0].message.content == task["answer"])
