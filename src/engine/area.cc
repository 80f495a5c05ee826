// Area engine: sources land here.
