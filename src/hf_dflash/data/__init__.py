"""Training data for a drafter: prompts in, the target's own responses out, with a loss mask on the responses.

One job per module, lower ones first (each imports only those above it):

- ``prompts``: the packaged prompt sets (benchmark and training) and the ``Prompt`` type;
- ``chat``: the chat template, rendered and probed in one place (input text and ids, user header, turn closers,
  end-of-turn ids);
- ``tokens``: the pad id for a target and its tokenizer, and left padding (the stop cut is the Hub file's
  ``cut_at_stop``);
- ``records``: the records file (one JSON record per line), its resume rules, and loading it for training;
- ``evaluation``: keeping the benchmark sets' items out of training prompts;
- ``regenerate``: the one write/resume loop, and answering with the target loaded in process;
- ``sources``: training prompts from packaged sets, JSONL files, datasets, or the target itself;
- ``server``: answering through an OpenAI-compatible server, through the same loop.

Nothing is re-exported here: import from the module that owns a name.
"""
