// Area model: sources land here.
