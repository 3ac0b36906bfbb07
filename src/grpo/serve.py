"""`python -m grpo.serve <vLLM api_server args>`: alias of `python -m grpo.inference.server` (console: grpo-serve)."""

from grpo.inference.server import main

if __name__ == "__main__":
    main()
