#!/usr/bin/env python3
"""A flat trace for cost-per-token measurements: N requests of L prompt tokens each, every
prompt block unique (no prefix reuse), 8 output tokens, all arriving at 0 ms. Mooncake format
with 512-token hash blocks.

    python3 tests/traces/flat/flat.py L N > flat.jsonl
    kvrelay run --trace flat.jsonl
"""
import json
import sys


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    length, n = int(sys.argv[1]), int(sys.argv[2])
    blocks = -(-length // 512)
    for i in range(n):
        ids = list(range(i * blocks, (i + 1) * blocks))
        print(json.dumps({"timestamp": 0, "input_length": length, "output_length": 8, "hash_ids": ids}))


if __name__ == "__main__":
    main()
