"""The tokenize stage: JSONL or Parquet to Megatron's MMIDIDX .bin/.idx (stage), as one process or
as a SLURM job array joined into the same bytes (array, shards), with the tokenizer it encodes with:
GPT-2 files, a BPE trained on the corpus (bpe) or a HuggingFace tokenizer.json (hf_encoder); the
bundled sample corpus (sample_corpus).

    python -m tasks.tokenize --input 'data/*.jsonl.zst' --output-prefix out/corpus ...
"""
