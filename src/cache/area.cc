// Area cache: sources land here.
