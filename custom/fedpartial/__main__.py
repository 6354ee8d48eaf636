from fedpartial.cli import main

main()
