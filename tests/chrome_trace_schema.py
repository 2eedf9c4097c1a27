"""A JSON schema of the Chrome Trace Event Format's JSON object form, the part of it
collectives.trace writes (and Perfetto's JSON importer reads): the spec is Google's "Trace
Event Format" document (docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).

Each event names its phase (``ph``); what else it must carry depends on the phase:
complete slices (``X``) a start and a duration, async begin/end (``b``/``e``) a category
and an id, instants (``i``) a scope, metadata (``M``) one of the known names and its args.
"""

_NUMBER = {"type": "number"}
_ID = {"type": ["integer", "string"]}

EVENT = {
    "type": "object",
    "required": ["ph", "pid", "name"],
    "properties": {
        "ph": {"enum": ["B", "E", "X", "i", "I", "b", "n", "e", "M", "C", "s", "t", "f"]},
        "name": {"type": "string"},
        "cat": {"type": "string"},
        "pid": {"type": "integer", "minimum": 0},
        "tid": {"type": ["integer", "string"]},
        "ts": _NUMBER,
        "dur": {"type": "number", "minimum": 0},
        "id": _ID,
        "s": {"enum": ["g", "p", "t"]},
        "args": {"type": "object"},
    },
    "allOf": [
        {"if": {"properties": {"ph": {"const": "X"}}},
         "then": {"required": ["ts", "dur"]}},
        {"if": {"properties": {"ph": {"enum": ["b", "e", "n"]}}},
         "then": {"required": ["ts", "id", "cat"]}},
        {"if": {"properties": {"ph": {"enum": ["i", "I"]}}},
         "then": {"required": ["ts"]}},
        {"if": {"properties": {"ph": {"enum": ["B", "E", "C"]}}},
         "then": {"required": ["ts"]}},
        {"if": {"properties": {"ph": {"const": "M"}}},
         "then": {"required": ["args"],
                  "properties": {"name": {"enum": ["process_name", "process_labels",
                                                   "process_sort_index", "thread_name",
                                                   "thread_sort_index"]}}}},
        {"if": {"properties": {"ph": {"const": "M"}, "name": {"const": "process_name"}}},
         "then": {"properties": {"args": {"required": ["name"],
                                          "properties": {"name": {"type": "string"}}}}}},
        {"if": {"properties": {"ph": {"const": "M"},
                               "name": {"const": "process_sort_index"}}},
         "then": {"properties": {"args": {"required": ["sort_index"],
                                          "properties": {"sort_index":
                                                         {"type": "integer"}}}}}},
    ],
}

TRACE = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "items": EVENT},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
}


def check_chrome_trace(document: dict) -> dict[int, str]:
    """Validate ``document`` against :data:`TRACE` (``jsonschema.ValidationError`` if it
    is not a Chrome trace); returns the name of each row (pid -> process_name), checking
    that every event's pid has exactly one."""
    import jsonschema

    jsonschema.Draft7Validator.check_schema(TRACE)
    jsonschema.validate(document, TRACE, cls=jsonschema.Draft7Validator)
    events = document["traceEvents"]
    names: dict[int, str] = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            assert e["pid"] not in names, f"two names for row {e['pid']}"
            names[e["pid"]] = e["args"]["name"]
    rows = {e["pid"] for e in events}
    assert rows == set(names), f"rows without a name: {sorted(rows - set(names))}"
    return names
