"""Data: from raw text to token shards, and the tokenizers on the way.

- :mod:`utils.data.textio`    line-oriented text I/O (one document per line, escapes)
- :mod:`utils.data.mediawiki` the MediaWiki XML dump reader (pages, namespaces, redirects)
- :mod:`utils.data.wikitext`  wikitext -> plain text (templates rendered, markup dropped)
- :mod:`utils.data.hub`       Hugging Face datasets, local paths first (offline-safe)
- :mod:`utils.data.samples`   the offline sample corpora a package ships
- :mod:`utils.data.tok`       loading, training and fingerprinting tokenizers; the one encoder
- :mod:`utils.data.spm`       SentencePiece ``.model`` files as tokenizers
- :mod:`utils.data.parallel`  an ordered process-pool map for the prep stages
- :mod:`utils.data.packing`   documents -> BOS/EOS-framed token streams -> shard files
- :mod:`utils.data.shards`    the shard format (.npy + metadata), its reader and validator
- :mod:`utils.data.sft`       chat templates, SFT example encoding and loss masks

Importing any of them has no side effects.
"""
