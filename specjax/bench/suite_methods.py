"""The benchmark suite's method names by family, and which of them count as each peer's.

Shared by the suite's runner (`specjax.bench.suite`) and its report
(`specjax.bench.suite_report`), so the report needs nothing from the runner.
"""

SPECJAX_METHODS = ("autoregressive", "ngram", "ngram_corpus", "draft", "medusa", "eagle",
                   "ngram_eagle")
# n-gram that also drafts from a corpus of earlier outputs (`--ngram-corpus`): run only
# where that corpus is given
CORPUS_METHODS = ("ngram_corpus",)
# n-gram's chain where lookup matches, the EAGLE head's tree elsewhere (`Hybrid`): named
# in --methods to run
OPT_IN_METHODS = ("ngram_eagle",)
HF_METHODS = ("hf_generate", "hf_assistant", "hf_prompt_lookup")
# llama.cpp (llama-cpp-python, the bench extra): batch 1, named in --methods to run.
LLAMACPP_METHODS = ("llamacpp", "llamacpp_prompt_lookup", "llamacpp_draft", "llamacpp_q4_1")
# each llama.cpp method's `llamacpp.Runner` mode
LLAMACPP_MODES = {"llamacpp": "plain", "llamacpp_prompt_lookup": "prompt_lookup",
                  "llamacpp_draft": "draft", "llamacpp_q4_1": "plain"}

# The peers each row is compared with: their methods on the same weights (llamacpp_q4_1
# runs other weights, so it is no peer's best)
PEERS = {"transformers": HF_METHODS,
         "llamacpp": ("llamacpp", "llamacpp_prompt_lookup", "llamacpp_draft")}
