"""The agent of treerl's built-in tool world (`treerl train agent_tools`): look a record up, answer one field.

Plain Python with the OpenAI SDK; nothing from treerl is imported. treerl calls `episode` with an
`openai.AsyncOpenAI` client pointed at its recording proxy and one task, a dict such as
{"question": "code of 7?", "id": 7, "answer": "3", "records": {"7": {"id": 7, "code": 3}, ...}},
and trains on every model call the episode makes, with the reward it returns.
"""

import json
import re

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "the record with this id",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}


async def episode(client, task: dict) -> float:
    """Have the model call lookup, run it, show the record, ask for the code. Reward: 0.8 for the right code
    (else 0.3 for the code of the record shown, else 0.1 x the share of digits), 0.1 for looking up the right
    record, 0.1 x the share of the expected arguments written in place (small credits let a random-init
    model start learning)."""
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=[LOOKUP], max_tokens=10,
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    reply = first.choices[0].message
    call = reply.tool_calls[0]
    number = re.search(r"\d+", call.function.arguments)  # a forgiving tool: the first number is the id
    record = task["records"].get(number.group()) if number else None
    messages.append(reply.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps(record) if record else "error: no such record"})
    second = await client.chat.completions.create(
        model="policy", messages=messages, tools=[LOOKUP], tool_choice="none", max_tokens=3)
    answer = second.choices[0].message.content or ""
    expected, written = json.dumps({"id": task["id"]}), call.function.arguments
    well_written = sum(a == b for a, b in zip(written, expected)) / max(len(written), len(expected))
    found = record is not None and record["id"] == task["id"]
    if answer == task["answer"]:
        credit = 0.8
    elif record is not None and answer == str(record["code"]):
        credit = 0.3  # grounded in what the tool said, for the wrong record
    else:
        credit = 0.1 * sum(c.isdigit() for c in answer) / max(len(answer), 1)
    return 0.1 * found + 0.1 * well_written + credit
