"""Domain data, teacher generations, logit cache, draft construction, KD losses, trainer, tokenizer identity."""
