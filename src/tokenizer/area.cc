// Area tokenizer: sources land here.
