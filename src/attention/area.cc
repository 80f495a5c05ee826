// Area attention: sources land here.
