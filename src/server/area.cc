// Area server: sources land here.
