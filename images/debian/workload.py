# The Debian guest's python3 test (images/debian/workload.py; kpin-workload runs it as
# `python3 workload.py FILE`). Its output is deterministic: kpin-workload hashes it.
import hashlib
import json
import sys


def main():
    path = sys.argv[1]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            digest.update(chunk)
    print("file", digest.hexdigest())

    # A JSON round trip: nested lists and dicts, ints beyond 64 bits, exact binary floats,
    # non-ASCII text.
    doc = {
        "rows": [
            {"i": i, "square": i * i, "big": 3**i, "half": i / 2, "name": "zeile-%d-\u00e9" % i}
            for i in range(2000)
        ],
        "nested": {"a": [1, [2, [3, [4]]]], "b": None, "c": True},
    }
    text = json.dumps(doc, sort_keys=True, ensure_ascii=False)
    back = json.loads(text)
    assert back == doc, "the JSON round trip changed the document"
    again = json.dumps(back, sort_keys=True, ensure_ascii=False)
    assert again == text, "the JSON text is not stable"
    print("json", len(text), hashlib.sha256(text.encode("utf-8")).hexdigest())

    # Integer and float arithmetic.
    total = sum(pow(7, i, 1000003) for i in range(100000))
    harmonic = sum(1.0 / k for k in range(1, 100001))
    print("arith", total, repr(harmonic))


main()
