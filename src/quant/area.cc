// Area quant: sources land here.
